"""The seccomp filter of the code sandbox: a small classic-BPF program that bubblewrap loads (`--seccomp FD`).

It refuses (EPERM) the system calls that reach out of the sandbox's namespaces or widen the kernel's attack surface:
- `ptrace`, `process_vm_readv/writev`, `kcmp`, `pidfd_getfd`: another process's memory or files (the PID namespace
  already hides the parent; this also covers processes of the sandbox itself);
- `socket`: every socket family. The network namespace has no route out, but a Unix socket file on the read-only
  root (a 0777 socket, a Docker or X11 socket) can still be connected to across namespaces; `socketpair` stays;
- `io_uring_*`: its ring runs socket and file operations that seccomp would never see;
- namespaces and mounts (`unshare`, `setns`, `clone` with a CLONE_NEW* flag, `mount` and the new mount API,
  `pivot_root`), keys (`keyctl`, `add_key`, `request_key`), `bpf`, `perf_event_open`, `userfaultfd`, modules, kexec,
  `open_by_handle_at`, `syslog`, `acct`, `quotactl`, swap and reboot;
- `clone3` answers ENOSYS: its flags sit behind a pointer a filter cannot read, and glibc then falls back to `clone`.
A system call of another ABI (i386 on x86_64, x32) kills the process. Known architectures: x86_64 and aarch64.
The numbers come from the kernel's tables (`asm/unistd_64.h`, `asm-generic/unistd.h`); a test checks them against
the headers where they are installed.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64, little-endian low word first)
_NR, _ARCH, _ARG0 = 0, 4, 16
# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45  # BPF_JMP | BPF_JEQ/JGE/JSET | BPF_K
_RET_K = 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_X32_BIT = 0x40000000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME (0x80: CLONE_NEWTIME)
_CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

REFUSED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "socket", "io_uring_setup",
           "io_uring_enter", "io_uring_register", "unshare", "setns", "mount", "umount2", "pivot_root", "fsopen",
           "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr", "keyctl", "add_key",
           "request_key", "bpf", "perf_event_open", "userfaultfd", "init_module", "finit_module", "delete_module",
           "kexec_load", "kexec_file_load", "open_by_handle_at", "name_to_handle_at", "syslog", "acct", "quotactl",
           "swapon", "swapoff", "reboot")

# machine -> (AUDIT_ARCH_*, x32 ABI exists, syscall numbers)
_X86_64 = dict(ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312, pidfd_getfd=438, socket=41,
               io_uring_setup=425, io_uring_enter=426, io_uring_register=427, unshare=272, setns=308, mount=165,
               umount2=166, pivot_root=155, fsopen=430, fsconfig=431, fsmount=432, fspick=433, move_mount=429,
               open_tree=428, mount_setattr=442, keyctl=250, add_key=248, request_key=249, bpf=321,
               perf_event_open=298, userfaultfd=323, init_module=175, finit_module=313, delete_module=176,
               kexec_load=246, kexec_file_load=320, open_by_handle_at=304, name_to_handle_at=303, syslog=103,
               acct=163, quotactl=179, swapon=167, swapoff=168, reboot=169, clone=56, clone3=435)
_AARCH64 = dict(ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272, pidfd_getfd=438, socket=198,
                io_uring_setup=425, io_uring_enter=426, io_uring_register=427, unshare=97, setns=268, mount=40,
                umount2=39, pivot_root=41, fsopen=430, fsconfig=431, fsmount=432, fspick=433, move_mount=429,
                open_tree=428, mount_setattr=442, keyctl=219, add_key=217, request_key=218, bpf=280,
                perf_event_open=241, userfaultfd=282, init_module=105, finit_module=273, delete_module=106,
                kexec_load=104, kexec_file_load=294, open_by_handle_at=265, name_to_handle_at=264, syslog=116,
                acct=89, quotactl=60, swapon=224, swapoff=225, reboot=142, clone=220, clone3=435)
ARCHITECTURES: dict[str, tuple[int, bool, dict[str, int]]] = {
    "x86_64": (0xC000003E, True, _X86_64),
    "aarch64": (0xC00000B7, False, _AARCH64),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(machine: str | None = None) -> bytes:
    """The filter as `struct sock_filter[]` bytes for `machine` (default: this one); KeyError on an unknown one.

    Layout: check the ABI, load the call number, one compare per refused call (jumping to the EPERM return), then
    `clone3` (to ENOSYS) and `clone` (its flags word tested for CLONE_NEW*), then the four returns (BPF jumps only
    forward, at most 255 instructions)."""
    audit_arch, has_x32, numbers = ARCHITECTURES[machine or platform.machine()]
    body: list[tuple[int, int, str | None, str | None]] = [(_JEQ_K, numbers[name], "eperm", None)
                                                           for name in REFUSED]
    if has_x32:
        body.insert(0, (_JGE_K, _X32_BIT, "kill", None))
    body += [(_JEQ_K, numbers["clone3"], "enosys", None), (_JEQ_K, numbers["clone"], None, "allow"),
             (_LD_W_ABS, _ARG0, None, None), (_JSET_K, _CLONE_NEW_FLAGS, "eperm", "allow")]
    head = [_insn(_LD_W_ABS, _ARCH), _insn(_JEQ_K, audit_arch, jt=1), _insn(_RET_K, _RET_KILL_PROCESS),
            _insn(_LD_W_ABS, _NR)]
    start = len(head)
    end = start + len(body)
    returns = {"allow": end, "eperm": end + 1, "enosys": end + 2, "kill": end + 3}
    program = list(head)
    for i, (code, k, true, false) in enumerate(body):
        here = start + i
        jt = returns[true] - here - 1 if true else 0
        jf = returns[false] - here - 1 if false else 0
        program.append(_insn(code, k, jt, jf) if code != _LD_W_ABS else _insn(code, k))
    program += [_insn(_RET_K, _RET_ALLOW), _insn(_RET_K, _RET_ERRNO | errno.EPERM),
                _insn(_RET_K, _RET_ERRNO | errno.ENOSYS), _insn(_RET_K, _RET_KILL_PROCESS)]
    return b"".join(program)
