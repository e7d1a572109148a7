"""Run a deploy shell script under real bash with the heavy commands replaced by recorders.

bash itself does the quoting, `\\` line continuations, `$'...'` strings, `$VAR` and `$(( ))` expansion and the
control flow, so what the recorders see is exactly the argv the real commands would get. PATH holds only the
recorders and a few harmless read-only tools: a command the script needs that is neither fails with 127.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

RECORDED = ("python", "python3", "deepspeed", "torchrun", "ray", "pip", "rlhfkit", "sky", "sleep", "nvidia-smi")
TOOLS = ("bash", "head", "tail", "cat", "tr", "cut", "wc", "grep", "sed", "awk", "seq", "date", "dirname",
                   "basename", "ls", "env", "printf")
_END = "\x1e"  # record separator written after each call's NUL-separated argv

_RECORDER = """#!/bin/bash
printf '%s\\0' "${0##*/}" "$@" $'\\036' >> "$STUB_CALLS"
"""


@dataclass
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str
    calls: list[list[str]]  # each: [command name, arg1, arg2, ...]


def run_with_stubs(script: str, env: dict[str, str], workdir: Path, cwd: Path | None = None,
                   also_record: tuple[str, ...] = ()) -> ScriptRun:
    """Run `script` with bash, the RECORDED commands (and `also_record`) replaced by recorders under `workdir`."""
    bin_dir = workdir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in (*RECORDED, *also_record):
        path = bin_dir / name
        path.write_text(_RECORDER)
        path.chmod(0o755)
    for name in TOOLS:
        real = shutil.which(name)
        if real and not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(real)
    calls_file = workdir / "calls.bin"
    calls_file.write_bytes(b"")
    full_env = {"PATH": str(bin_dir), "HOME": str(workdir), "STUB_CALLS": str(calls_file), "LANG": "C.UTF-8",
                **env}
    proc = subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True, env=full_env,
                          cwd=cwd or workdir, timeout=60)
    return ScriptRun(proc.returncode, proc.stdout, proc.stderr, parse_calls(calls_file.read_bytes()))


def parse_calls(data: bytes) -> list[list[str]]:
    calls, current = [], []
    for item in data.decode().split("\0")[:-1]:
        if item == _END:
            calls.append(current)
            current = []
        else:
            current.append(item)
    return calls


@dataclass
class RlhfkitCall:
    module: str  # e.g. "train_sft" for rlhfkit.cli.train_sft
    argv: list[str]
    launcher: str  # how it was started: python, deepspeed, torchrun, rlhfkit, or "ray job submit"


def rlhfkit_calls(calls: list[list[str]]) -> list[RlhfkitCall]:
    """The rlhfkit commands among recorded calls, with `ray job submit -- CMD` unwrapped.

    Raises ValueError for a call that names rlhfkit in a form this does not recognise, so a new launch form cannot
    slip past the flag check unnoticed.
    """
    found = []
    for call in calls:
        name, args = call[0], call[1:]
        if name == "ray" and args[:2] == ["job", "submit"]:
            if "--" not in args:
                raise ValueError(f"ray job submit without `--` before the command: {call}")
            inner = args[args.index("--") + 1:]
            found += [RlhfkitCall(c.module, c.argv, "ray job submit") for c in rlhfkit_calls([inner])]
            continue
        hit = _match(name, args)
        if hit is not None:
            found.append(hit)
        elif any("rlhfkit.cli" in a for a in call):
            raise ValueError(f"unrecognised rlhfkit invocation: {call}")
    return found


def _match(name: str, args: list[str]) -> RlhfkitCall | None:
    prefix = "rlhfkit.cli."
    flag = {"python": "-m", "python3": "-m", "torchrun": "-m", "deepspeed": "--module"}.get(name)
    if flag and flag in args:
        i = args.index(flag)
        if i + 1 < len(args) and args[i + 1].startswith(prefix):
            return RlhfkitCall(args[i + 1][len(prefix):], args[i + 2:], name)
    if name == "rlhfkit" and args:
        from rlhfkit.cli.main import COMMANDS

        spec = COMMANDS.get(args[0]) or COMMANDS.get(args[0].replace("_", "-"))
        return RlhfkitCall(spec[0] if spec else args[0], args[1:], name)
    return None

