"""cgroup v1 pids+memory slots: one per sandbox process, nested under our own cgroup."""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")
_CONTROLLERS = ("pids", "memory")


def _own_path(controller: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path.lstrip("/")
    raise OSError(f"not in a {controller} cgroup")


@dataclass
class Cgroup:
    """A pids+memory cgroup pair; processes join by writing their pid to `procs_files`."""

    dirs: dict[str, Path]

    @classmethod
    def create(cls, max_procs: int, memory_bytes: int) -> Cgroup | None:
        """A fresh slot, or None where cgroup v1 pids/memory are not writable."""
        name = f"jaxagent-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        dirs: dict[str, Path] = {}
        try:
            for controller in _CONTROLLERS:
                d = _ROOT / controller / _own_path(controller) / name
                d.mkdir()
                dirs[controller] = d
            (dirs["pids"] / "pids.max").write_text(str(max_procs))
            (dirs["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
            swap = dirs["memory"] / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no escaping the limit into swap
                swap.write_text(str(memory_bytes))
        except OSError:
            cls(dirs).remove()
            return None
        return cls(dirs)

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def pids(self) -> list[int]:
        text = (self.dirs["pids"] / "cgroup.procs").read_text()
        return [int(p) for p in text.split()]

    def oom_kills(self) -> int:
        count = oom_kill_count(self.dirs["memory"] / "memory.oom_control")
        return int((self.dirs["memory"] / "memory.failcnt").read_text()) if count is None else count

    def kill_all(self) -> None:
        for _ in range(100):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        for d in self.dirs.values():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still busy: exiting processes not yet gone
                    time.sleep(0.01)


def oom_kill_count(path: Path) -> int | None:
    """The `oom_kill` line of a memory.oom_control (v1) or memory.events (v2) file."""
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None


def oom_counter(pid: int) -> Path | None:
    """The file counting OOM kills in the memory cgroup of process `pid` (a container's init)
    as this host sees it; None where it is not visible."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if not names:  # cgroup v2 (or the hybrid layout's unified tree, without memory)
            candidate = _ROOT / path.lstrip("/") / "memory.events"
        elif "memory" in names.split(","):
            candidate = _ROOT / "memory" / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        if candidate.exists():
            return candidate
    return None
