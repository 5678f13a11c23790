"""The code sandbox's seccomp filter (rewards/sandbox.py): kernel-facing system calls
(ptrace, mount, bpf, keyctl, new namespaces, ...) fail with EPERM, and sockets other
than AF_UNIX with EACCES; everything else is allowed (a deny list: it narrows the
kernel's surface, it is not a full allow-list policy)."""

from __future__ import annotations

import errno
import os
import tempfile

_DENIED_SYSCALLS = (
    "ptrace",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "setns",
    "unshare",
    "personality",
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "io_uring_setup",
    "userfaultfd",
    "process_vm_readv",
    "process_vm_writev",
)


def seccomp_fd() -> int:
    """A file descriptor holding the compiled BPF filter (read by bwrap --seccomp)."""
    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in _DENIED_SYSCALLS:
        f.add_rule(sc.ERRNO(errno.EPERM), name)
    f.add_rule(sc.ERRNO(errno.EACCES), "socket", sc.Arg(0, sc.NE, 1))  # only AF_UNIX
    tmp = tempfile.TemporaryFile()
    f.export_bpf(tmp)
    tmp.flush()
    fd = os.dup(tmp.fileno())
    tmp.close()
    os.lseek(fd, 0, os.SEEK_SET)  # bwrap reads the program from the start
    return fd
