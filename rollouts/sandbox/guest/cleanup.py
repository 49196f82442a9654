"""What the sandboxes' long-lived processes (the zygote, a docker session's container) use to
leave nothing of a run behind. Stdlib only: it runs inside the sandbox."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys


def reap() -> None:
    """Collect every child that has exited, without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return


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
    """rmtree error hook: the solution may have chmod-ed its files to 000."""
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path):
        os.chmod(path, 0o700)
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
