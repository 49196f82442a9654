"""`RunCache`: test runs shared by the sessions whose work dirs hold the same bytes.

A session's command sees nothing of earlier commands but the work dir (the bwrap command server
empties /tmp and /dev/shm after each, and kills what it left), so a run of a deterministic test
suite is a function of the work dir's contents, the command and the sandbox's settings. In a
GRPO group every episode's first `run_tests` sees the pristine repository, and the episodes that
make the same edit test the same files: on the embedded agent family 78% of the runs of an RL
step repeat one already made (docs/agent.md). A run is kept only where it left the work dir as
it found it (a run that writes files must run again, so its writes happen) and ended by itself
(no timeout, no dead server, within the disk quota). It changes what the agent reads, never a
reward: grading runs in a fresh sandbox of its own (`rewards.Scorer`, with its own verdict
cache). Flaky suites (timing, unseeded randomness) would read their first outcome again, which
is why the agent config turns it on per task family (`agent.test_cache`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any


def workdir_digest(root: str | Path) -> bytes:
    """sha256 over everything under `root`, .git included: each entry's relative path, kind,
    permission bits, and a file's bytes or a link's target, in sorted order. Where an entry
    cannot be read (a command made it unreadable to the host), a digest of its own that no
    other call returns: such a work dir is never matched."""
    h = hashlib.sha256()
    root = str(root)
    try:
        for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                full = os.path.join(dirpath, name)
                st = os.lstat(full)
                rel = os.path.relpath(full, root).encode("utf-8", "surrogateescape")
                h.update(b"\0%s\0%o\0" % (rel, st.st_mode))
                if stat.S_ISLNK(st.st_mode):
                    h.update(os.fsencode(os.readlink(full)))
                elif stat.S_ISREG(st.st_mode):
                    with open(full, "rb") as f:
                        h.update(b"%d\0" % st.st_size)
                        h.update(f.read())
    except OSError:
        return os.urandom(h.digest_size)
    return h.digest()


def _raise(error: OSError) -> None:
    raise error


class RunCache:
    """The last `size` clean test runs (an `ExecResult` and its outcomes, their output at most
    `max_bytes` together) by the digest of what decided them; thread-safe, shared by many
    sessions. A lookup of a run in flight waits for it (a group's episodes take their first
    turn together), and runs itself if that run was not kept. `hits` count the lookups a kept
    run answered, `misses` those that ran."""

    def __init__(self, size: int = 4096, max_bytes: int = 64 << 20):
        if size < 1 or max_bytes < 1:
            raise ValueError(f"RunCache size and max_bytes must be >= 1, got {size}, {max_bytes}")
        self.size, self.max_bytes = size, max_bytes
        self.hits = self.misses = self.bytes = 0
        self._runs: OrderedDict[bytes, Future] = OrderedDict()
        self._sizes: dict[bytes, int] = {}  # the output bytes of each kept run
        self._lock = threading.Lock()

    @staticmethod
    def key(workdir: bytes, *settings) -> bytes:
        """The digest of a work dir's and the run's settings (backend, image, limits, argv...)."""
        return hashlib.sha256(pickle.dumps((workdir, settings))).digest()

    def run(self, key: bytes, run: Callable[[], tuple[Any, dict, bool]]) -> tuple[Any, dict]:
        """The run kept under `key` (its `ExecResult` marked `cached`), else `run()`'s
        (result, outcomes), kept where `run` says it may be."""
        with self._lock:
            shared = self._runs.get(key)
            if shared is None:
                self.misses += 1
                mine = self._runs[key] = Future()
                self._evict()
            else:
                self._runs.move_to_end(key)
        if shared is not None:
            kept = shared.result()
            if kept is not None:
                with self._lock:
                    self.hits += 1
                result, outcomes = kept
                return dataclasses.replace(result, cached=True), dict(outcomes)
            with self._lock:
                self.misses += 1
            result, outcomes, _ = run()  # that run was not kept: this one is not either
            return result, outcomes
        keep = False
        try:
            result, outcomes, keep = run()
        finally:
            with self._lock:
                if self._runs.get(key) is mine:
                    if keep:
                        self._sizes[key] = len(result.output)
                        self.bytes += self._sizes[key]
                        self._evict()
                    else:
                        del self._runs[key]
            mine.set_result((result, outcomes) if keep else None)
        return result, outcomes

    def _evict(self) -> None:
        """Drop the least recently used runs past `size` or `max_bytes` (the lock held)."""
        while self._runs and (len(self._runs) > self.size or self.bytes > self.max_bytes):
            key, _ = self._runs.popitem(last=False)
            self.bytes -= self._sizes.pop(key, 0)
