"""Take every privilege from a process before it runs untrusted code.

Stdlib only: it runs inside the sandbox, where no packages are visible. The grader forks a
solution with `fork_isolated()` and calls `confine()` in the child; `limited.py`
calls `confine()` before it execs an agent's shell command. What the solution is left with:

* where the sandbox runs as root, an unprivileged uid/gid of its own (the host picks one per
  sandbox, so no two sandboxes share an `RLIMIT_NPROC` count or files): it can signal,
  trace or read no process of the grader's; elsewhere, where it must keep the grader's uid,
  its own pid namespace (the grader and zygote have no pid there) and mount namespace with
  a fresh /proc of that pid namespace, both ending with it;
* no capabilities (effective, permitted, inheritable, ambient and bounding sets empty),
  `no_new_privs`;
* a seccomp filter (`seccomp_program`) that refuses mounts, namespaces, ptrace and
  cross-process memory access, kernel keyrings, bpf, perf, io_uring, module and kexec loading,
  terminal injection, and any foreign syscall ABI.

`set_limits` applies the solution's rlimits (the grader's and limited.py's one definition).

The namespaces are best effort (Docker's default profile forbids them; the container's uid
and capability drop then hold the line); the last two are not: `confine` raises
`ConfinementError` and the caller must not run the solution.
"""

from __future__ import annotations

import ctypes
import os
import resource
import struct
from pathlib import PurePosixPath

_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_NAMESPACE_FLAGS = 0x7E020080  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 0x4000, 1 << 18
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP = 24, 38, 22
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_PR_SET_DUMPABLE = 4
_SECCOMP_MODE_FILTER = 2
_CAPABILITY_VERSION_3 = 0x20080522
_EPERM, _ENOSYS = 1, 38

# name: (x86_64, aarch64) syscall numbers.
DENIED = {
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "unshare": (272, 97), "setns": (308, 268), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438), "process_madvise": (440, 440), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "keyctl": (250, 219),
    "add_key": (248, 217), "request_key": (249, 218), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "swapon": (167, 224), "swapoff": (168, 225),
    "reboot": (169, 142), "acct": (163, 89), "syslog": (103, 116), "quotactl": (179, 60),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "adjtimex": (159, 171), "sethostname": (170, 161), "setdomainname": (171, 162),
    "fanotify_init": (300, 262), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "vhangup": (153, 58),
}  # fmt: skip
_CLONE = (56, 220)
_CLONE3 = (435, 435)  # ENOSYS, not EPERM: glibc then falls back to clone, which we can check
_IOCTL = (16, 29)
_TTY_INJECTION = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX
_ARCH = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
_X32_BIT = 0x40000000

# classic BPF opcodes
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL = 0x7FFF0000, 0x80000000
_RET_ERRNO = 0x00050000
_NR, _ARCH_AT, _ARG0, _ARG1 = 0, 4, 16, 24  # offsets in struct seccomp_data (low words)


class ConfinementError(RuntimeError):
    """A privilege could not be dropped: the solution must not run."""


def seccomp_program(machine: str | None = None) -> bytes:
    """The filter as `struct sock_filter[]` bytes for `machine` (default: this one)."""
    machine = machine or os.uname().machine
    if machine not in _ARCH:
        raise ConfinementError(f"no seccomp syscall table for {machine!r}")
    col, audit_arch = _ARCH[machine]
    # (code, jump-if-true label, jump-if-false label, k); labels resolve below
    prog: list[tuple] = [(_LD_ABS, None, None, _ARCH_AT), (_JEQ, None, "kill", audit_arch)]
    prog.append((_LD_ABS, None, None, _NR))
    if machine == "x86_64":
        prog.append((_JGE, "eperm", None, _X32_BIT))
    for nrs in DENIED.values():
        prog.append((_JEQ, "eperm", None, nrs[col]))
    prog += [(_JEQ, "enosys", None, _CLONE3[col]), (_JEQ, "clone", None, _CLONE[col])]
    prog += [(_JEQ, "ioctl", None, _IOCTL[col]), (_RET, None, None, _RET_ALLOW)]
    labels = {"clone": len(prog)}
    prog += [(_LD_ABS, None, None, _ARG0), (_JSET, "eperm", None, _NAMESPACE_FLAGS)]
    prog.append((_RET, None, None, _RET_ALLOW))
    labels["ioctl"] = len(prog)
    prog.append((_LD_ABS, None, None, _ARG1))
    prog += [(_JEQ, "eperm", None, cmd) for cmd in _TTY_INJECTION]
    prog.append((_RET, None, None, _RET_ALLOW))
    for name, value in (("eperm", _RET_ERRNO | _EPERM), ("enosys", _RET_ERRNO | _ENOSYS),
                        ("kill", _RET_KILL)):  # fmt: skip
        labels[name] = len(prog)
        prog.append((_RET, None, None, value))
    out = b""
    for i, (code, jt, jf, k) in enumerate(prog):
        # a jump's offset counts from the next instruction; None falls through
        out += struct.pack(
            "<HBBI", code, labels[jt] - i - 1 if jt else 0, labels[jf] - i - 1 if jf else 0, k
        )
    return out


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def set_dumpable(dumpable: bool) -> None:
    """PR_SET_DUMPABLE: a process that is not dumpable cannot be ptraced, nor its
    /proc/<pid>/mem or fds opened, by other processes of its uid."""
    _libc().prctl(_PR_SET_DUMPABLE, int(dumpable), 0, 0, 0)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        raise ConfinementError(f"{what} failed: {os.strerror(ctypes.get_errno())}")


def fork_isolated() -> tuple[int, bool]:
    """os.fork() for a solution: (pid, whether the child is pid 1 of a new pid namespace).

    As root the solution becomes another uid, which already keeps it from signalling,
    tracing or reading the grader and zygote (and costs nothing per run: a namespace, its
    /proc and a stand-in init add ~4 ms to a ~10 ms run on a 2-core VM). Otherwise it keeps
    our uid, and only a pid namespace of its own hides them. The caller can start no thread
    after that unshare (its children would belong elsewhere), so it starts them first."""
    isolated = os.geteuid() != 0 and _libc().unshare(_CLONE_NEWPID) == 0
    return os.fork(), isolated


def _private_mounts(hide: list[str]) -> None:
    """A mount namespace of our own with a /proc of our pid namespace, and an empty
    read-only tmpfs over each directory of `hide` (nothing where the kernel forbids it)."""
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS) != 0:
        return
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    _check(libc.mount(b"proc", b"/proc", b"proc", flags, None), "mounting /proc")
    for sub in (b"/proc/sys", b"/proc/sysrq-trigger", b"/proc/irq", b"/proc/bus"):
        if libc.mount(sub, sub, None, _MS_BIND, None) == 0:  # as bwrap does: read-only
            remount = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags
            _check(libc.mount(None, sub, None, remount, None), f"read-only {sub.decode()}")
    for path in hide:
        _check(libc.mount(b"none", path.encode(), b"tmpfs", flags | _MS_RDONLY, None), f"hiding {path}")


def own(workdir: str, uid: int, keep: tuple[str, ...] = ()) -> None:
    """Hand the work dir to the solution's uid (never following a link), except the paths
    of `keep` (a repository's tests), which stay ours and read-only to it; the directories
    above them stay ours too, sticky and world-writable, so nothing kept can be renamed away."""
    above = {str(p) for k in keep for p in PurePosixPath(k).parents} if keep else set()
    for rel in above:
        if os.path.isdir(os.path.join(workdir, rel)):
            os.chmod(os.path.normpath(os.path.join(workdir, rel)), 0o1777)
    if not above:
        os.lchown(workdir, uid, uid)
    for root, dirs, files in os.walk(workdir):
        for name in dirs + files:
            rel = os.path.relpath(os.path.join(root, name), workdir)
            kept = rel in above or any(PurePosixPath(rel).is_relative_to(k) for k in keep)
            if not kept:
                os.lchown(os.path.join(root, name), uid, uid)


def _drop_capabilities(uid: int) -> None:
    libc = _libc()
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:
        last = 63
    for cap in range(last + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: checked below
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if os.geteuid() == 0:  # leaving uid 0 clears the effective and permitted sets
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = struct.pack("<Ii", _CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two empty {effective, permitted, inheritable} words
    _check(libc.capset(header, data), "capset")


def _status() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def confine(
    uid: int, workdir: str | None = None, private_mounts: bool = False, hide: tuple[str, ...] = (),
    keep: tuple[str, ...] = (),
) -> None:
    """Drop everything (see the module docstring), or raise ConfinementError.

    `uid`: the unprivileged uid (and gid) to become where we run as root; `workdir` is then
    handed to it, but for the paths of `keep` (see `own`). `private_mounts`: this process is pid 1 of its own pid namespace
    (`fork_isolated`) and gets a mount namespace and /proc of its own, where the
    directories of `hide` are empty (the grader's; as root they are another uid's)."""
    if private_mounts:
        _private_mounts([p for p in hide if os.path.isdir(p)])
    if os.geteuid() == 0 and workdir is not None:
        own(workdir, uid, keep)
    _drop_capabilities(uid)
    _check(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    program = seccomp_program()
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(
        _libc().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
        "seccomp",
    )
    status = _status()
    caps = {k: int(status.get(k, "1"), 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}  # fmt: skip
    if any(caps.values()) or status.get("NoNewPrivs") != "1" or status.get("Seccomp") != "2":
        raise ConfinementError(f"privileges remain after confinement: {status}")
    if os.getuid() == 0:
        raise ConfinementError("the solution would run as uid 0")


def set_limits(limits: dict) -> None:
    """The solution's rlimits (types.Limits as a dict); RLIMIT_NPROC counts per uid."""
    mb = 1 << 20
    pairs = {
        resource.RLIMIT_CPU: (int(limits["cpu_s"]), int(limits["cpu_s"]) + 1),
        resource.RLIMIT_AS: (limits["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (limits["file_size_mb"] * mb,) * 2,
        resource.RLIMIT_NOFILE: (64, 64),
        resource.RLIMIT_NPROC: (limits["max_procs"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        # POSIX message queues outlive processes and cannot be listed for cleanup.
        resource.RLIMIT_MSGQUEUE: (0, 0),
    }
    for which, value in pairs.items():
        resource.setrlimit(which, value)
