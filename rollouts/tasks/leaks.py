"""What must not reach a feature-deletion task: generated copies of the code, and any other
copy of a deleted body.

`generated(path)` names the build outputs, caches, rendered docs, coverage reports and patch
leftovers that are dropped from a task's repository and from every commit of its history
(they hold copies of the code, often verbatim). `find_leaks` then looks for the deleted bodies
in whatever text is left: tokens, not characters, so a re-indented or reformatted copy matches;
HTML is read with its tags stripped and entities unescaped (rendered source pages), and a copy
with every identifier renamed matches when the body is long enough for that not to be chance.
"""

from __future__ import annotations

import builtins
import html
import keyword
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

# Directories anywhere in the tree whose content is generated from the sources.
_GENERATED_DIRS = {
    "__pycache__", "build", "dist", ".eggs", ".tox", ".nox", ".mypy_cache", ".pytype", ".pyre",
    ".ruff_cache", ".pytest_cache", ".hypothesis", "htmlcov", ".ipynb_checkpoints", "site",
    "_build", ".venv", "venv", "node_modules", ".benchmarks", "pip-wheel-metadata", ".cache",
}
# Bytecode and built extensions (a copy of the code, disassemblable), patch and editor leftovers.
_GENERATED_SUFFIXES = (".pyc", ".pyo", ".pyd", ".so", ".orig", ".rej", ".bak", ".swp", ".swo",
                       "~", ".whl")
_GENERATED_NAMES = re.compile(r"^(\.coverage(\..*)?|coverage\.xml|nosetests\.xml|\.dmypy\.json|"
                              r"#.*#|\..*\.sw[a-p])$")

# A whole body shorter than this (in tokens) is too common to call a copy (`return x`).
MIN_TOKENS = 8
# Any run of this many consecutive tokens of a body, identifiers as written, is a copy.
WINDOW = 16
# A whole body at least this long, with every identifier renamed, is a copy.
MIN_RENAMED = 20

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|\S")
_TAG = re.compile(r"<[^<>]*>")
_KEEP = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


def generated(path: str) -> bool:
    """Whether `path` (relative, POSIX) is a generated or cached artefact, not a source."""
    parts = PurePosixPath(path).parts
    if any(p in _GENERATED_DIRS or p.endswith((".egg-info", ".dist-info")) for p in parts[:-1]):
        return True
    name = parts[-1]
    return name.endswith(_GENERATED_SUFFIXES) or bool(_GENERATED_NAMES.match(name))


def _tokens(text: str) -> tuple[list[str], list[int]]:
    """Tokens of `text` and the line each starts on."""
    toks, lines, line, last = [], [], 1, 0
    for m in _TOKEN.finditer(text):
        line += text.count("\n", last, m.start())
        last = m.start()
        toks.append(m.group())
        lines.append(line)
    return toks, lines


def _renamed(toks: list[str]) -> list[str]:
    return [t if t in _KEEP or not (t[0].isalpha() or t[0] == "_") else "N" for t in toks]


def _joined(toks: list[str]) -> str:
    return "\0" + "\0".join(toks) + "\0"


@dataclass(frozen=True)
class Leak:
    path: str
    line: int
    name: str  # the deleted function whose body it copies

    def __str__(self) -> str:
        return f"{self.path}:{self.line} holds a copy of the deleted body of {self.name}"


class Body:
    """The token patterns of one deleted body."""

    def __init__(self, name: str, source: str):
        self.name = name
        self.lines = sum(1 for line in source.splitlines() if line.strip())  # of code, for stats
        toks, _ = _tokens(source)
        self.exact = [] if len(toks) < MIN_TOKENS else sorted({
            _joined(toks[i:i + WINDOW]) for i in range(max(1, len(toks) - WINDOW + 1))})
        self.renamed = _joined(_renamed(toks)) if len(toks) >= MIN_RENAMED else None

    def find(self, text: str | Scanned) -> int | None:
        """The line where the first copy starts in `text`, or None."""
        scanned = text if isinstance(text, Scanned) else Scanned(text)
        for k, (joined, lines) in enumerate(scanned.views):
            found = [i for pattern in self.exact if (i := joined.find(pattern)) >= 0]
            if found:
                return lines[joined.count("\0", 0, min(found))]
            if self.renamed:
                renamed = scanned.renamed_views()[k]
                if (i := renamed.find(self.renamed)) >= 0:
                    return lines[renamed.count("\0", 0, i)]
        return None


class Scanned:
    """A text's token views, made once for all the bodies searched in it: as written, and
    (when it has tags) with HTML tags stripped and entities unescaped."""

    def __init__(self, text: str):
        variants = (text, html.unescape(_TAG.sub(" ", text))) if "<" in text else (text,)
        self._tokens = [_tokens(v) for v in variants]
        self.views = [(_joined(toks), lines) for toks, lines in self._tokens]
        self._renamed: list[str] | None = None

    def renamed_views(self) -> list[str]:
        """The views with identifiers renamed (made on first use)."""
        if self._renamed is None:
            self._renamed = [_joined(_renamed(toks)) for toks, _ in self._tokens]
        return self._renamed


def find_leaks(bodies: Iterable[Body], files: Mapping[str, str | bytes]) -> list[Leak]:
    """Every text file of `files` that holds a copy of one of `bodies` (binary files are
    skipped: generated binaries are dropped by `generated`, and the rest carry no source)."""
    bodies = list(bodies)
    leaks = []
    for path, content in sorted(files.items()):
        if isinstance(content, bytes) or not bodies:
            continue
        scanned = Scanned(content)
        leaks += [Leak(path, line, body.name) for body in bodies
                  if (line := body.find(scanned)) is not None]
    return leaks
