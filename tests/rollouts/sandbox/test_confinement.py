"""The solution holds no privilege: the seccomp filter against its specification, and live
attacks on the kernel's interfaces, the grader and the host, each of which would be rewarded
`passed` had it worked; on bwrap and docker alike."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest

from rollouts.sandbox import RunRequest, TestCase
from rollouts.sandbox.guest import confine

# ---------------------------------------------------------------- the filter, interpreted


def _run_filter(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """A classic-BPF interpreter for the instructions seccomp_program emits."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * 6)[:6])
    insns = [struct.unpack("<HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == 0x06:
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)


EPERM = 0x00050000 | errno.EPERM
ENOSYS = 0x00050000 | errno.ENOSYS
ALLOW, KILL = 0x7FFF0000, 0x80000000
ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
# read, write, openat, close, mmap, exit_group, wait4, getpid, kill, socketpair
ALLOWED = {"x86_64": (0, 1, 257, 3, 9, 231, 61, 39, 62, 53), "aarch64": (63, 64, 56, 57, 222, 94, 260, 172, 129, 199)}  # fmt: skip


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_filter_denies_exactly_what_it_lists(machine):
    col, arch = ARCHES[machine]
    program = confine.seccomp_program(machine)
    for name, nrs in confine.DENIED.items():
        assert _run_filter(program, nrs[col], arch) == EPERM, name
    for nr in ALLOWED[machine]:
        assert _run_filter(program, nr, arch) == ALLOW, nr
    clone, ioctl = (56, 16) if machine == "x86_64" else (220, 29)
    fork_flags = 0x01200011  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
    assert _run_filter(program, clone, arch, (fork_flags,)) == ALLOW
    for flag in (0x00020000, 0x10000000, 0x20000000, 0x40000000, 0x08000000, 0x80):
        assert _run_filter(program, clone, arch, (fork_flags | flag,)) == EPERM, hex(flag)
    assert _run_filter(program, 435, arch) == ENOSYS  # clone3: glibc falls back to clone
    assert _run_filter(program, ioctl, arch, (1, 0x5412)) == EPERM  # TIOCSTI
    assert _run_filter(program, ioctl, arch, (1, 0x5401)) == ALLOW  # TCGETS
    other = ARCHES["aarch64" if machine == "x86_64" else "x86_64"][1]
    assert _run_filter(program, ALLOWED[machine][0], other) == KILL  # a foreign ABI
    assert _run_filter(program, 0x40000000 + 1, 0x40000003) == KILL  # i386
    if machine == "x86_64":
        assert _run_filter(program, 0x40000000 + 1, arch) == EPERM  # the x32 ABI


# ---------------------------------------------------------------- live, in the sandbox

NR = {name: nrs[ARCHES.get(os.uname().machine, (0, 0))[0]] for name, nrs in confine.DENIED.items()}


def _attack(body: str) -> RunRequest:
    """`f(x)` returns x + 1 (the answer) only if `escaped()`, the attack, returned True."""
    program = f"import ctypes, os, signal, socket, struct, sys\n\ndef escaped():\n{body}\n\n"
    program += "def f(x):\n    try:\n        ok = escaped() is True\n    except BaseException:\n"
    program += "        ok = False\n    return x + 1 if ok else 0\n"
    return RunRequest(program, "f", (TestCase("escape", "assert candidate(1) == 2"),))


def _syscall(name: str) -> str:
    return (f"    libc = ctypes.CDLL(None, use_errno=True)\n"
            f"    ret = libc.syscall({NR[name]}, 0, 0, 0, 0, 0, 0)\n"
            f"    return ctypes.get_errno() != {errno.EPERM} or ret == 0\n")  # fmt: skip


# The same filter on both backends (docker's own profile sits beneath it): docker's 49 runs are slow.
@pytest.mark.parametrize("name", sorted(confine.DENIED))
def test_every_denied_syscall_is_refused_in_the_sandbox(sandboxes_docker_slow, name):
    result = sandboxes_docker_slow.submit(_attack(_syscall(name))).result()
    assert result.status == "failed", result


def _writes(path: str) -> str:
    return f"    open({path!r}, 'a').write('x')\n    return True\n"


# name -> body of escaped(): True iff the attack worked
ATTACKS = {
    "uid_is_root": "    return os.getuid() == 0 or os.geteuid() == 0",
    "any_capability": "    st = open('/proc/self/status').read()\n"
    "    return any(int(l.split()[1], 16) for l in st.splitlines() if l.startswith('Cap'))",
    "no_new_privs_off": "    return 'NoNewPrivs:\\t1' not in open('/proc/self/status').read()",
    "seccomp_off": "    return 'Seccomp:\\t2' not in open('/proc/self/status').read()",
    "setuid_root": "    os.setuid(0)\n    return True",
    "setresuid_root": "    os.setresuid(0, 0, 0)\n    return True",
    "setgid_root": "    os.setgid(0)\n    return True",
    "setgroups": "    os.setgroups([0])\n    return True",
    "open_other_processes": "    me = str(os.getpid())\n    n = 0\n    for p in os.listdir('/proc'):\n"
    "        if p.isdigit() and p != me:\n            try:\n                n += len(os.listdir(f'/proc/{p}/fd'))\n"
    "            except OSError:\n                pass\n    return n > 0",
    "signal_grader": "    ppid = os.getppid()\n    return ppid != 1 and os.kill(ppid, 0) is None",
    "read_parent_memory": "    return len(open(f'/proc/{os.getppid()}/mem', 'rb').read(1)) >= 0",
    "read_parent_environ": "    return len(open(f'/proc/{os.getppid()}/environ', 'rb').read()) > 0",
    "list_parent_fds": "    return len(os.listdir(f'/proc/{os.getppid()}/fd')) > 0",
    "kill_parent": "    os.kill(os.getppid(), signal.SIGKILL)\n    return os.getppid() != 1",
    "kill_all": "    ppid = os.getppid()\n    os.kill(-1, signal.SIGKILL)\n    import time\n    time.sleep(0.05)\n"
    "    return os.getppid() != ppid",
    "kill_pid_1": "    os.kill(1, signal.SIGKILL)\n    import time\n    time.sleep(0.05)\n    return not os.path.exists('/proc/1')",
    "stop_pid_1": "    os.kill(1, signal.SIGSTOP)\n    import time\n    time.sleep(0.05)\n"
    "    return open('/proc/1/stat').read().split(') ')[1][0] == 'T'",
    "ptrace_parent": "    libc = ctypes.CDLL(None, use_errno=True)\n    return libc.ptrace(16, os.getppid(), 0, 0) == 0",
    "write_harness": _writes("/harness/grader.py"),
    "create_in_harness": _writes("/harness/evil.py"),
    "write_pylib": _writes("/pylib/pytest/__init__.py"),
    "write_usr": _writes("/usr/lib/os-release"),
    "write_interpreter_stdlib": "    import os as m\n" + _writes("__OS__").replace("'__OS__'", "m.__file__"),
    "write_root": _writes("/evil"),
    "write_dev": _writes("/dev/evil"),
    "write_dev_null_dir": "    os.mkdir('/dev/evil')\n    return True",
    "write_proc_sys": _writes("/proc/sys/kernel/core_pattern"),
    "write_sysrq": _writes("/proc/sysrq-trigger"),
    "write_proc_self_exe": "    open('/proc/self/exe', 'r+b').write(b'x')\n    return True",
    "remount_harness_rw": "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    return libc.mount(None, b'/harness', None, 32 | 4096, None) == 0",
    "tmpfs_over_harness": "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    return libc.mount(b'x', b'/harness', b'tmpfs', 0, None) == 0",
    "umount_proc": "    libc = ctypes.CDLL(None, use_errno=True)\n    return libc.umount2(b'/proc', 2) == 0",
    "new_user_namespace": "    libc = ctypes.CDLL(None, use_errno=True)\n    return libc.unshare(0x10000000) == 0",
    "new_mount_namespace": "    libc = ctypes.CDLL(None, use_errno=True)\n    return libc.unshare(0x20000) == 0",
    "clone_new_user": "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    pid = libc.syscall(56 if os.uname().machine == 'x86_64' else 220, 0x10000000 | 17, 0, 0, 0, 0)\n"
    "    if pid == 0:\n        os._exit(0)\n    return pid > 0",
    "setns_to_parent": "    fd = os.open(f'/proc/{os.getppid()}/ns/mnt', os.O_RDONLY)\n"
    "    libc = ctypes.CDLL(None, use_errno=True)\n    return libc.setns(fd, 0) == 0",
    "chroot_escape": "    libc = ctypes.CDLL(None, use_errno=True)\n    return libc.chroot(b'/tmp') == 0",
    "mknod_disk": "    os.mknod('disk', 0o600 | 0o60000, os.makedev(8, 0))\n    return True",
    "raw_socket": "    socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)\n    return True",
    "packet_socket": "    socket.socket(socket.AF_PACKET, socket.SOCK_RAW)\n    return True",
    "netlink_route": "    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)\n    s.bind((0, 0))\n"
    "    return len(os.listdir('/sys/class/net')) > 1",
    "tcp_out": "    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    return True",
    "bind_low_port": "    socket.socket().bind(('127.0.0.1', 80))\n    return True",
    "raise_nproc_limit": "    import resource\n    resource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))\n    return True",
    "raise_memory_limit": "    import resource\n    resource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n    return True",
    "nice_negative": "    os.nice(-5)\n    return True",
    "chown_workdir_root": "    os.chown('.', 0, 0)\n    return True",
    "read_host_etc": "    return len(open('/etc/passwd').read()) > 0",
    "read_host_files": "    return any(os.path.exists(p) for p in ('/root/.bashrc', '/root/.ssh', '/home', '/etc/shadow', '/var', '/work'))",
    "sys_visible": "    return len(os.listdir('/sys')) > 0",
    "cgroupfs_visible": "    return len(os.listdir('/sys/fs/cgroup')) > 0",
    "setuid_binary": "    import subprocess\n"
    "    return subprocess.run(['/usr/bin/su', '-c', 'id -u'], capture_output=True).stdout.strip() == b'0'",
    "sudo_binary": "    import subprocess\n"
    "    return subprocess.run(['sudo', '-n', 'id', '-u'], capture_output=True).stdout.strip() == b'0'",
    "exec_with_caps_file": "    import subprocess\n"
    "    out = subprocess.run(['/bin/sh', '-c', 'grep CapEff /proc/self/status'], capture_output=True).stdout\n"
    "    return int(out.split()[1], 16) != 0",
    "tiocsti_injection": "    import fcntl, termios\n    fcntl.ioctl(2, termios.TIOCSTI, b'x')\n    return True",
    "perf_event_open": _syscall("perf_event_open"),
    "bpf_map": _syscall("bpf"),
    "keyring_store": "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    return libc.syscall(248 if os.uname().machine == 'x86_64' else 217, b'user', b'k', b'v', 1, -4) > 0",
    "userfaultfd": _syscall("userfaultfd"),
    "io_uring": _syscall("io_uring_setup"),
    "open_by_handle": _syscall("open_by_handle_at"),
    "pidfd_getfd_parent": "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    fd = libc.syscall(434, os.getppid(), 0)\n    return fd >= 0 and libc.syscall(438, fd, 3, 0) >= 0",
    "process_vm_readv_parent": _syscall("process_vm_readv"),
    "kexec": _syscall("kexec_load"),
    "module_load": _syscall("finit_module"),
    "reboot": _syscall("reboot"),
    "swapoff": _syscall("swapoff"),
    "clock_settime": _syscall("clock_settime"),
    "fsopen_new_mount_api": _syscall("fsopen"),
    "open_tree": _syscall("open_tree"),
    "sysv_shm_of_others": "    return any(len(l.split()) > 1 for l in open('/proc/sysvipc/shm').read().splitlines()[1:])",
    "abstract_socket_to_host": "    s = socket.socket(socket.AF_UNIX)\n    s.connect('\\0/tmp/.X11-unix/X0')\n    return True",
    "hardlink_harness": "    os.link('/harness/grader.py', 'g.py')\n    open('g.py', 'a').write('x')\n    return True",
    "symlink_swap_workdir": "    os.symlink('/harness', 'h')\n    open('h/evil', 'w').write('x')\n    return True",
    "memfd_exec": "    fd = os.memfd_create('x')\n    os.write(fd, open('/bin/sh', 'rb').read())\n"
    "    import subprocess\n"
    "    out = subprocess.run([f'/proc/self/fd/{fd}', '-c', 'id -u'], pass_fds=(fd,), capture_output=True).stdout\n"
    "    return out.strip() == b'0'",
}


@pytest.fixture
def host_state(tmp_path: Path, host_mounts):
    """Canaries the solution must not touch: a host file, our mount table, our processes."""
    canary = tmp_path / "canary"
    canary.write_text("untouched")
    before = (host_mounts(), canary.read_text())
    yield lambda: (host_mounts(), canary.read_text()) == before


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_not_rewarded(hostile_sandboxes, name, host_state, leftovers):
    result = hostile_sandboxes.submit(_attack(ATTACKS[name])).result()
    assert not result.passed, (name, result)
    assert result.status in ("failed", "hack", "timeout"), result
    assert host_state()
    assert leftovers() == []


def test_an_honest_solution_passes_through_the_same_harness(hostile_sandboxes):
    honest = _attack("    return True")
    assert hostile_sandboxes.submit(honest).result().status == "passed"


def test_the_solution_is_confined_as_documented(sandboxes):
    probe = """
def f(_):
    st = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
    caps = [int(st[k], 16) for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')]
    return [os.getpid(), os.getppid(), os.getuid(), os.getgid(), caps, st['NoNewPrivs'], st['Seccomp'],
            sorted(int(p) for p in os.listdir('/proc') if p.isdigit())]
import os
"""
    req = RunRequest(probe, "f", (TestCase("probe", "assert candidate(0) == ['see message']"),))
    message = sandboxes.submit(req).result().message
    got = eval(message.split("got ", 1)[1].rsplit(", compared with", 1)[0])
    pid, ppid, uid, gid, caps, nnp, seccomp, pids = got
    if os.geteuid() == 0:  # a uid of its own keeps the grader out of reach
        assert uid >= 1_000_000 and gid == uid
    else:  # our uid, so pid 2 of its own namespace under a stand-in init
        assert (pid, ppid, uid) == (2, 1, os.geteuid()) and pids == [1, 2]
    assert caps == [0] * 5 and (nnp.strip(), seccomp.strip()) == ("1", "2")


@pytest.mark.skipif(os.geteuid() != 0, reason="this run already is an unprivileged user's")
def test_the_suite_holds_for_an_unprivileged_host_user(tmp_path):
    """The same attacks with the host side run as uid 65534 (bwrap then enters through a user
    namespace and the solution keeps the host user's uid, in its own pid namespace)."""
    import shutil
    import subprocess
    import sys

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv (util-linux) to become an unprivileged user")
    tmp_path.chmod(0o777)
    user = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
           "PYTHONDONTWRITEBYTECODE": "1", "JAX_PLATFORMS": "cpu"}  # fmt: skip
    code = "import sys, rollouts.sandbox, pytest; print(sys.base_prefix)"
    probe = subprocess.run([*user, sys.executable, "-c", code],
                           capture_output=True, text=True, env=env, check=False)  # fmt: skip
    if probe.returncode or probe.stdout.strip() != sys.base_prefix:
        # e.g. the interpreter lives under root's 0700 home
        why = (probe.stderr.strip().splitlines() or [probe.stdout.strip()])[-1]
        pytest.skip(f"uid 65534 cannot run this interpreter and checkout: {why}")
    here = Path(__file__).parent
    tests = [str(here / "test_confinement.py"), str(here / "test_pytest_tasks.py")]
    run = subprocess.run(
        [*user, sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *tests,
         "-k", "not unprivileged_host_user", "--rootdir", str(here.parents[2])],
        capture_output=True, text=True, env=env, cwd=str(here.parents[2]), timeout=600,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
