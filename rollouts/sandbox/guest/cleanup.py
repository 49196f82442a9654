"""What the sandboxes' long-lived processes (the zygote, a bwrap session's command server, a
docker session's container) use to leave nothing of a run behind. Stdlib only: it runs inside the sandbox."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def reap() -> None:
    """Collect every child that has exited, without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return


def become_subreaper() -> None:
    """Orphans (daemonised grandchildren) reparent to us, so `kill_descendants` finds them."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants() -> bool:
    """SIGKILL everything below us until nothing is left; False if it would not die."""
    me = os.getpid()
    for _ in range(200):
        reap()  # zombies need no kill, and reaping them first saves a sleep
        pids = _descendants(me)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.001)
    return False


_IPC_RMID = 0


def remove_sysv_ipc() -> None:
    """Runs share the sandbox's IPC namespace: drop every SysV object a run left behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    removers = {
        "shm": lambda ipc_id: libc.shmctl(ipc_id, _IPC_RMID, None),
        "sem": lambda ipc_id: libc.semctl(ipc_id, 0, _IPC_RMID),
        "msg": lambda ipc_id: libc.msgctl(ipc_id, _IPC_RMID, None),
    }
    for kind, remove in removers.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            remove(int(row.split()[1]))


def _unlock(func, path, _exc) -> None:
    """rmtree error hook: the solution may have chmod-ed its files to 000. A directory that
    could not be opened (func is os.open or os.scandir, which take more than a path) is
    removed whole once it can be; anything else is removed again by `func`."""
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
        if func not in (os.rmdir, os.unlink, os.remove):
            shutil.rmtree(path, **_RMTREE_HOOK)
            return
    func(path)


_RMTREE_HOOK = (
    {"onexc": _unlock} if sys.version_info >= (3, 12) else {"onerror": _unlock}
)


def wipe(root: str) -> bool:
    """Empty the work root; False (the sandbox gets recycled) if anything resists."""
    try:
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, **_RMTREE_HOOK)
            else:
                os.unlink(path)
    except (OSError, RecursionError):
        return False
    return True
