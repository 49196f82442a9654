"""Notes that persist across episodes of one repository: a JSON file per repository under
the run's work dir (the host writes it; the sandbox never sees it)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path

MAX_NOTE_CHARS = 500
MAX_NOTES = 50  # the oldest notes go first


class MemoryStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._lock = threading.Lock()  # concurrent episodes of one repository

    def _file(self, repo: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", repo)[:64]
        digest = hashlib.sha256(repo.encode()).hexdigest()[:12]
        return self.root / f"{safe}-{digest}.json"

    def read(self, repo: str) -> list[str]:
        file = self._file(repo)
        if not file.exists():
            return []
        try:
            notes = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: memory store is not valid JSON ({e})") from None
        return [str(n) for n in notes]

    def write(self, repo: str, note: str) -> int:
        """Append `note` (truncated to MAX_NOTE_CHARS); returns the number of notes kept."""
        with self._lock:
            notes = (self.read(repo) + [note[:MAX_NOTE_CHARS]])[-MAX_NOTES:]
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self._file(repo).with_suffix(".tmp")
            tmp.write_text(json.dumps(notes, indent=1))
            tmp.replace(self._file(repo))
            return len(notes)
