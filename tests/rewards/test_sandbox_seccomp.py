"""The sandbox's seccomp filter, read by an independent classic-BPF interpreter (below) for both architectures; its
system call numbers against the kernel headers where they are installed; and the refusal without bubblewrap."""

from __future__ import annotations

import errno
import re
import struct
from pathlib import Path

import pytest

from rlhfkit.rewards import sandbox
from rlhfkit.rewards.sandbox_seccomp import ARCHITECTURES, REFUSED, build_filter

ALLOW, KILL = 0x7FFF0000, 0x80000000
HEADERS = {"x86_64": (Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"), r"#define __NR_(\w+)\s+(\d+)"),
           "aarch64": (Path("/usr/include/asm-generic/unistd.h"), r"#define __NR(?:3264)?_(\w+)\s+(\d+)")}


def run_bpf(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """A classic-BPF interpreter for the instructions a seccomp filter uses, over one struct seccomp_data."""
    data = struct.pack("<IIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    a, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld w abs
            a = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == 0x06:  # ret k
            return k
        else:
            taken = {0x15: a == k, 0x35: a >= k, 0x45: bool(a & k)}[code]
            pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("machine", sorted(ARCHITECTURES))
def test_filter_refuses_the_listed_calls_and_allows_the_rest(machine):
    audit_arch, has_x32, numbers = ARCHITECTURES[machine]
    program = build_filter(machine)
    eperm, enosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    for name in REFUSED:
        assert run_bpf(program, numbers[name], audit_arch) == eperm, name
    assert run_bpf(program, numbers["clone3"], audit_arch) == enosys
    refused = {numbers[n] for n in REFUSED} | {numbers["clone"], numbers["clone3"]}
    for nr in set(range(500)) - refused:  # read, write, fork, exec, mmap, ...: allowed
        assert run_bpf(program, nr, audit_arch) == ALLOW, nr
    fork_flags, thread_flags = 0x01200011, 0x003D0F00  # glibc's fork (SIGCHLD|CHILD_SETTID|..), pthread_create
    assert run_bpf(program, numbers["clone"], audit_arch, fork_flags) == ALLOW
    assert run_bpf(program, numbers["clone"], audit_arch, thread_flags) == ALLOW
    for new_namespace in (0x10000000, 0x20000000, 0x40000000, 0x00020000):  # NEWUSER, NEWPID, NEWNET, NEWNS
        assert run_bpf(program, numbers["clone"], audit_arch, fork_flags | new_namespace) == eperm
    assert run_bpf(program, 0, 0x40000003) == KILL  # another ABI (i386)
    if has_x32:
        assert run_bpf(program, 0x40000000 | 41, audit_arch) == KILL  # x32's socket


@pytest.mark.parametrize("machine", sorted(ARCHITECTURES))
def test_syscall_numbers_match_the_kernel_headers(machine):
    header, pattern = HEADERS[machine]
    if not header.exists():
        pytest.skip(f"{header} is not installed")
    table = {name: int(nr) for name, nr in re.findall(pattern, header.read_text())}
    assert {name: table[name] for name in ARCHITECTURES[machine][2]} == ARCHITECTURES[machine][2]


def test_without_bubblewrap_code_execution_refuses_in_one_line(monkeypatch):
    monkeypatch.setattr(sandbox, "cached_bwrap_problem", lambda python, as_root: "bubblewrap (bwrap) is not installed")
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    with pytest.raises(sandbox.SandboxUnavailable) as refused:
        sandbox.run_python("print(1)")
    message = str(refused.value)
    assert "\n" not in message and "bwrap) is not installed" in message and "RLHFKIT_UNSAFE_CODE_EXECUTION=1" in message
    assert refused.value.exit_code == 2  # a UserError: the CLI prints the line and exits 2


def test_accepted_risk_runs_with_the_audit_hook_only(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "cached_bwrap_problem", lambda python, as_root: "bubblewrap (bwrap) is not installed")
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    limits = sandbox.SandboxLimits(wall_seconds=5, cpu_seconds=2)
    ok = sandbox.run_python("print(6 * 7)", limits)
    assert (ok.status, ok.stdout, ok.isolation) == (sandbox.PASSED, "42\n", sandbox.UNSAFE)
    outside = tmp_path / "x.txt"
    bad = sandbox.run_python(f"open({str(outside)!r}, 'w').write('x')", limits)
    assert bad.status == sandbox.FAILED and "PermissionError: sandbox:" in bad.stderr and not outside.exists()


def test_home_is_emptied_but_an_interpreter_inside_it_stays_visible(monkeypatch, tmp_path):
    from rlhfkit.rewards import sandbox_bwrap

    home = tmp_path / "home"
    (home / "pyenv" / "bin").mkdir(parents=True)
    python = home / "pyenv" / "bin" / "python3"
    python.touch()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(sandbox_bwrap.sys, "executable", str(python))
    monkeypatch.setattr(sandbox_bwrap.sys, "base_prefix", str(home / "pyenv"))
    hidden, shown = sandbox_bwrap.hidden_and_shown(str(python))
    assert str(home) in hidden and shown == [str(home / "pyenv" / "bin"), str(home / "pyenv")]
    monkeypatch.setattr(sandbox_bwrap.sys, "base_prefix", str(tmp_path))  # a home inside the prefix: left alone
    hidden, shown = sandbox_bwrap.hidden_and_shown(str(python))
    assert str(home) not in hidden and shown == []
