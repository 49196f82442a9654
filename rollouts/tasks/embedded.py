"""The embedded repository `textkit` (rollouts/tasks/data/textkit) as a git repository with
a short history, for agent tasks, tests and demos: `history` has commits to show."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "textkit"
# The first version of slugify, replaced by the fourth commit (so a diff exists to show).
_OLD_SLUGIFY = '''    words = text.lower().split()
    return sep.join(words)
'''
_NEW_SLUGIFY = '''    words = re.findall(r"[a-z0-9]+", text.lower())
    return sep.join(words)
'''
_COMMITS = (
    ("textkit: string helpers and their tests",
     ("textkit/__init__.py", "textkit/strings.py", "tests/test_strings.py")),
    ("stats: mean, median, variance and RunningMean",
     ("textkit/stats.py", "tests/test_stats.py")),
    ("roman: to_roman and from_roman", ("textkit/roman.py", "tests/test_roman.py")),
    ("slugify: split on any non-alphanumeric run, not only spaces", ("textkit/strings.py",)),
)
_GIT_ENV = {"GIT_AUTHOR_NAME": "textkit", "GIT_AUTHOR_EMAIL": "textkit@example.com",
            "GIT_COMMITTER_NAME": "textkit", "GIT_COMMITTER_EMAIL": "textkit@example.com",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git(repo: Path, *args: str, env: dict | None = None) -> str:
    """Run git in `repo` (a trusted repository of ours) and return its stdout."""
    proc = subprocess.run(["git", "-C", str(repo), "-c", "safe.directory=*", *args],
                          check=False, capture_output=True, text=True, env={**os.environ, **_GIT_ENV, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout


def build_embedded_repo(dest: str | Path) -> Path:
    """Create the textkit git repository (4 commits, fixed dates) at `dest`."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=False)
    git(dest, "init", "-q", "-b", "main")
    for day, (message, paths) in enumerate(_COMMITS, start=1):
        for rel in paths:
            text = (DATA / rel).read_text()
            if rel == "textkit/strings.py" and day == 1:
                text = text.replace(_NEW_SLUGIFY, _OLD_SLUGIFY)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(text)
        git(dest, "add", "--", *paths)
        date = f"2026-01-{day:02d}T12:00:00+00:00"
        git(dest, "commit", "-q", "-m", message, env={"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date})
    return dest
