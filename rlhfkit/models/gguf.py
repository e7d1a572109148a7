"""GGUF weights as a model source: `--pretrain model.gguf`, or `--pretrain DIR --gguf_file NAME`.

Transformers reads GGUF files (`from_pretrained(dir, gguf_file=...)`, with the `gguf` package) and dequantizes
them, but vLLM, DeepSpeed and `save_pretrained` all want a Hugging Face directory (`save_pretrained` refuses a
GGUF-loaded model). So the file is converted once into a plain Hugging Face directory, fp32 safetensors plus the
tokenizer the file carries, and every consumer (trainers, reference, engines, batch inference) is handed that
directory: the engine serves exactly the weights the trainer trains.

The cache: `$RLHFKIT_CACHE_DIR/gguf/<key>`, default `${XDG_CACHE_HOME:-~/.cache}/rlhfkit/gguf/<key>`, where the key
is the SHA-256 of the file's bytes (a moved or renamed file is not converted again; an edited one is). A directory
is complete once its `rlhfkit-gguf.json` exists; it is built under a temporary name and renamed into place, so runs
converting at once never see half a directory. In a launched run (deepspeed, torchrun) only each machine's local
rank 0 converts; the other ranks wait for it (a large model dequantized once per rank would not fit in memory).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rlhfkit.cache import cache_root
from rlhfkit.errors import UserError

MAGIC = b"GGUF"
SUFFIX = ".gguf"
MARKER = "rlhfkit-gguf.json"


def is_gguf_path(path: str | None) -> bool:
    """Whether `path` names a GGUF file by its suffix (what `--pretrain model.gguf` looks like)."""
    return bool(path) and str(path).lower().endswith(SUFFIX)


def gguf_source(pretrain: str | None, gguf_file: str | None, flag: str = "--pretrain") -> Path | None:
    """The GGUF file that `pretrain` (and `--gguf_file`) name, checked to be a GGUF file; None for a plain model
    directory or hub name."""
    if gguf_file:
        where = Path(pretrain or ".").expanduser()
        if not where.is_dir():
            raise UserError(f"--gguf_file {gguf_file}: {flag} must be the directory that holds it, "
                            f"not {pretrain or 'empty'}")
        return check_gguf_file(where / gguf_file, f"--gguf_file {gguf_file}")
    if is_gguf_path(pretrain):
        return check_gguf_file(Path(str(pretrain)).expanduser(), f"{flag} {pretrain}")
    return None


def check_gguf_file(path: Path, what: str) -> Path:
    """`path` is a readable file that starts with the GGUF magic bytes, or a UserError naming `what`."""
    if not path.is_file():
        raise UserError(f"{what}: no such file ({path})")
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        raise UserError(f"{what}: not a GGUF file (it does not start with the GGUF magic bytes)")
    return path


def file_key(path: Path) -> str:
    """The cache key of a GGUF file: the SHA-256 of its bytes (first 16 hex digits)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def converted_dir(path: Path) -> Path:
    """The cache directory the GGUF file at `path` converts into (it may not exist yet)."""
    return cache_root() / "gguf" / file_key(path)


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(line + "\n")


def resolve_pretrain(pretrain: str | None, gguf_file: str | None = None, flag: str = "--pretrain") -> str | None:
    """The Hugging Face directory to load: `pretrain` itself, or, when it names a GGUF file, its converted copy in
    the cache (converted now if this file never was; one line on stderr says which)."""
    source = gguf_source(pretrain, gguf_file, flag)
    if source is None:
        return pretrain
    target = converted_dir(source)
    if (target / MARKER).is_file():
        _say(f"rlhfkit: {flag} {source.name}: converted from GGUF before; loading the Hugging Face copy {target}")
        return str(target)
    _require_gguf_package()  # before saying anything: a missing package is the one line the user sees
    if os.environ.get("LOCAL_RANK", "0") != "0":  # one conversion per machine, not one per rank (memory)
        wait_for_conversion(target, source.name)
        return str(target)
    _say(f"rlhfkit: {flag} {source.name}: converting the GGUF weights once to a Hugging Face directory {target}")
    convert_gguf(source, target)
    return str(target)


def wait_for_conversion(target: Path, name: str) -> None:
    """On a rank other than its machine's first: wait for that rank's conversion into `target` (its launcher stops
    every rank if the conversion fails); RLHFKIT_GGUF_WAIT_S (default 3600) bounds the wait."""
    limit = float(os.environ.get("RLHFKIT_GGUF_WAIT_S", "3600"))
    deadline = time.monotonic() + limit
    while not (target / MARKER).is_file():
        if time.monotonic() > deadline:
            raise UserError(f"GGUF {name}: waited {limit:.0f} s for local rank 0 to convert it into {target}; "
                            "raise RLHFKIT_GGUF_WAIT_S for a large file")
        time.sleep(0.5)


def _require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise UserError("reading a GGUF file needs the gguf package, which is not installed: pip install gguf")


def convert_gguf(source: Path, target: Path) -> None:
    """Dequantize the GGUF file `source` into a Hugging Face directory at `target` (fp32 weights, config,
    generation config, tokenizer); a UserError when Transformers cannot read it."""
    _require_gguf_package()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its loading and saving bars would bury the line that says what happens
    try:
        _convert(source, target)
    finally:
        hf_logging.enable_progress_bar()


def _convert(source: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(source.parent), source.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise UserError(f"GGUF {source}: Transformers cannot load it: {first}") from None
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its config (without the GGUF
    # "quantization" marker) and copy the dequantized weights in.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache is read by other users' runs too
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(source.resolve()), "key": target.name}) + "\n")
        try:
            tmp.rename(target)
        except OSError:  # another rank or run finished first: its copy is the same
            if not (target / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
