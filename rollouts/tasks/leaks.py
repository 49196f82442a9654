"""What must not reach a feature-deletion task: generated copies of the code, and any other
copy of a deleted body.

`generated(path, content)` names the build outputs, caches, rendered docs, coverage reports,
patch leftovers, bytecode and archives holding any of them that are dropped from a task's
repository and from every commit of its history (they hold copies of the code, often
verbatim). `find_leaks` then looks for the deleted bodies in whatever is left: tokens, not
characters, so a re-indented or reformatted copy matches; every text is also read decoded
(HTML tags stripped and entities unescaped, backslash escapes and quoted-line joins undone as
in notebooks and .po files, base64 runs decoded), as words only (comment markers, doctest
prompts, diff signs and punctuation ignored), and with every identifier renamed when the body
is long enough for that not to be chance. Archives are opened (zip, tar, gzip, bz2, xz, nested)
and other binary files read for their printable runs.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import bz2
import gzip
import hashlib
import html
import io
import keyword
import lzma
import re
import tarfile
import tokenize
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

# Directories anywhere in the tree whose content is generated from the sources (or, for version
# control and IDE folders, pristine copies and local history of them).
_GENERATED_DIRS = {
    "__pycache__", "build", "dist", ".eggs", ".tox", ".nox", ".mypy_cache", ".pytype", ".pyre",
    ".ruff_cache", ".pytest_cache", ".hypothesis", "htmlcov", ".ipynb_checkpoints", "site",
    "_build", ".venv", "venv", "node_modules", ".benchmarks", "pip-wheel-metadata", ".cache",
    "site-packages", "dist-packages", "__pypackages__", ".pdm-build", "jupyter_execute",
    ".jupyter_cache", ".ropeproject", ".svn", ".hg", ".bzr", "_darcs", ".history", ".idea",
}
# Bytecode, built extensions and distributions (a copy of the code), patch, editor and coverage
# annotation leftovers.
_GENERATED_SUFFIXES = (".pyc", ".pyo", ".pyd", ".so", ".orig", ".rej", ".bak", ".swp", ".swo",
                       "~", ".whl", ".egg", ".pyz", ".cover", ",cover")
_GENERATED_NAMES = re.compile(r"^(\.coverage(\..*)?|coverage\.(xml|json|lcov)|lcov\.info|"
                              r"nosetests\.xml|\.dmypy\.json|#.*#|\..*\.sw[a-p])$")

# A whole body shorter than this (in tokens) is too common to call a copy (`return x`).
MIN_TOKENS = 8
# Any run of this many consecutive tokens of a body, identifiers as written, is a copy; so is
# any run of this many consecutive words (identifiers, keywords, numbers) of it.
WINDOW = 16
# A whole body at least this long, with every identifier renamed, is a copy.
MIN_RENAMED = 20
# Archives are opened this many levels deep and expanded to at most this many bytes.
ARCHIVE_DEPTH = 3
ARCHIVE_BYTES = 64 << 20

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|\S")
_WORD = re.compile(r"[A-Za-z_0-9]")
_TAG = re.compile(r"<[^<>]*>")
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[nrt\"'\\/])")
# Where one quoted line ends and the next begins: notebooks' JSON lists, .po files, C strings.
_JOIN = re.compile(r"(?:\\n)?\"[ \t]*,?[ \t]*(\r?\n)[ \t]*\"")
_BASE64 = re.compile(r"[A-Za-z0-9+/]{24,}={0,2}(?:[ \t]*\r?\n[ \t]*[A-Za-z0-9+/]{4,}={0,2})*")
_PRINTABLE_RUNS = re.compile(rb"[^\t\n\r\x20-\x7e]+")
# Statement separators, line continuations and trailing commas formatters add or remove.
_DROPPED = {";", "\\"}
_CLOSING = {")", "]", "}"}
_KEEP = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


def generated(path: str, content: str | bytes | None = None) -> bool:
    """Whether `path` (relative, POSIX) is a generated or cached artefact, not a source; with
    its `content`, also bytecode under any name and an archive holding an artefact (a zip of
    `__pycache__`, a source distribution: a tarball with PKG-INFO)."""
    parts = PurePosixPath(path).parts
    if any(p in _GENERATED_DIRS or p.endswith((".egg-info", ".dist-info")) for p in parts[:-1]):
        return True
    name = parts[-1]
    if name.endswith(_GENERATED_SUFFIXES) or _GENERATED_NAMES.match(name):
        return True
    if not isinstance(content, bytes):
        return False
    if _is_bytecode(content):
        return True
    members = _members(content)
    return members is not None and any(
        generated(m, data) or PurePosixPath(m).name == "PKG-INFO" for m, data in members)


def _is_bytecode(data: bytes) -> bool:
    """A .pyc header: a two-byte magic number of CPython 3 followed by \\r\\n."""
    return len(data) >= 16 and data[2:4] == b"\r\n" and 3000 <= int.from_bytes(data[:2], "little") < 4000


def _members(data: bytes) -> list[tuple[str, bytes]] | None:
    """An archive's files as (name, bytes) (a compressed single file is one member named ''),
    or None if `data` is not an archive; at most ARCHIVE_BYTES in all."""
    out, total = [], 0

    def add(name: str, blob: bytes) -> bool:
        nonlocal total
        total += len(blob)
        if total > ARCHIVE_BYTES:
            return False
        out.append((name, blob))
        return True

    if data[:4] == b"PK\x03\x04" or data[:4] == b"PK\x05\x06":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    if not info.is_dir() and not add(info.filename, z.read(info)):
                        break
            return out
        except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError):
            return None
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for member in tar:
                if member.isfile() and not add(member.name, tar.extractfile(member).read()):
                    break
        return out
    except (tarfile.TarError, OSError, EOFError, lzma.LZMAError, ValueError):
        pass
    for magic, module in ((b"\x1f\x8b", gzip), (b"BZh", bz2), (b"\xfd7zXZ\x00", lzma)):
        if data.startswith(magic):
            try:
                return [("", module.decompress(data)[:ARCHIVE_BYTES])]
            except (OSError, EOFError, ValueError, lzma.LZMAError):
                return None
    return None


def texts(path: str, content: str | bytes, depth: int = 0) -> Iterator[tuple[str, str]]:
    """(where, text) of everything in a file that can hold source: the file itself if it is
    text; each member of an archive (`archive.zip!pkg/mod.py`); else a binary's printable
    runs."""
    if isinstance(content, str):
        yield path, content
        return
    members = _members(content) if depth < ARCHIVE_DEPTH else None
    if members is None:
        yield path, _PRINTABLE_RUNS.sub(b" ", content).decode("ascii")
        return
    for name, data in members:
        where = f"{path}!{name}" if name else f"{path}!"
        try:
            yield where, data.decode("utf-8")
        except UnicodeDecodeError:
            yield from texts(where, data, depth + 1)


def _tokens(text: str) -> tuple[list[str], list[int]]:
    """Normalised tokens of `text` and the line each starts on: one kind of quote, no
    statement separators, line continuations or trailing commas."""
    toks, lines, line, last = [], [], 1, 0
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok in _DROPPED:
            continue
        line += text.count("\n", last, m.start())
        last = m.start()
        if tok in _CLOSING and toks and toks[-1] == ",":
            toks.pop()
            lines.pop()
        toks.append('"' if tok in ("'", "`") else tok)
        lines.append(line)
    return toks, lines


def _words(toks: list[str], lines: list[int]) -> tuple[list[str], list[int]]:
    keep = [i for i, t in enumerate(toks) if _WORD.match(t)]
    return [toks[i] for i in keep], [lines[i] for i in keep]


def _renamed(toks: list[str]) -> list[str]:
    return [t if t in _KEEP or not (t[0].isalpha() or t[0] == "_") else "N" for t in toks]


def _without_comments(source: str) -> str:
    """`source` with its comments blanked (a copy may have dropped them)."""
    try:
        comments = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    lines = source.splitlines(keepends=True)
    for t in reversed(comments):
        (row, col), (_, end) = t.start, t.end
        lines[row - 1] = lines[row - 1][:col] + " " * (end - col) + lines[row - 1][end:]
    return "".join(lines)


def _windows(toks: list[str], size: int) -> set[tuple[str, ...]]:
    return {tuple(toks[i:i + size]) for i in range(max(1, len(toks) - size + 1))}


@dataclass(frozen=True)
class Leak:
    path: str
    line: int
    name: str  # the deleted function whose body it copies

    def __str__(self) -> str:
        return f"{self.path}:{self.line} holds a copy of the deleted body of {self.name}"


class Body:
    """The token patterns of one deleted body (as written and without its comments): every
    run of WINDOW tokens and of WINDOW words, and the whole body renamed."""

    def __init__(self, name: str, source: str):
        self.name = name
        self.lines = sum(1 for line in source.splitlines() if line.strip())  # of code, for stats
        self.exact: set[tuple[str, ...]] = set()
        self.words: set[tuple[str, ...]] = set()
        self.renamed: set[tuple[str, ...]] = set()
        for text in {source, _without_comments(source)}:
            toks, lines = _tokens(text)
            if len(toks) >= MIN_TOKENS:
                self.exact |= _windows(toks, WINDOW)
            words, _ = _words(toks, lines)
            if len(words) >= WINDOW:
                self.words |= _windows(words, WINDOW)
            if len(toks) >= MIN_RENAMED:
                self.renamed.add(tuple(_renamed(toks)))

    def find(self, text: str | Scanned) -> int | None:
        """The line where the first copy starts in `text`, or None."""
        scanned = text if isinstance(text, Scanned) else Scanned(text)
        for view in scanned.views:
            found = [line for kind, patterns in (("exact", self.exact), ("words", self.words),
                                                 ("renamed", self.renamed))
                     if patterns and (line := view.find(kind, patterns)) is not None]
            if found:
                return min(found)
        return None


class _View:
    """One reading of a text: its tokens, its words and its renamed tokens, with the windows
    of each length asked for hashed once."""

    def __init__(self, toks: list[str], lines: list[int]):
        words, word_lines = _words(toks, lines)
        self._streams = {"exact": (toks, lines), "words": (words, word_lines)}
        self._index: dict[tuple[str, int], dict[int, list[int]]] = {}

    def _stream(self, kind: str) -> tuple[list[str], list[int]]:
        if kind == "renamed" and kind not in self._streams:
            toks, lines = self._streams["exact"]
            self._streams[kind] = (_renamed(toks), lines)
        return self._streams[kind]

    def find(self, kind: str, patterns: set[tuple[str, ...]]) -> int | None:
        """The line of the earliest run of `kind` tokens that is one of `patterns`."""
        toks, lines = self._stream(kind)
        found = []
        for size in sorted({len(p) for p in patterns}):
            index = self._index.get((kind, size))
            if index is None:
                index = {}
                for i in range(len(toks) - size + 1):
                    index.setdefault(hash(tuple(toks[i:i + size])), []).append(i)
                self._index[(kind, size)] = index
            found += [i for p in patterns if len(p) == size for i in index.get(hash(p), ())
                      if tuple(toks[i:i + size]) == p]
        return lines[min(found)] if found else None


def _decoded(text: str) -> str:
    """`text` with HTML tags stripped (their line breaks kept), entities unescaped, quoted
    lines joined and backslash escapes undone (line breaks as spaces: line numbers hold)."""
    if "<" in text:
        text = _TAG.sub(lambda m: "\n" * m.group().count("\n") or " ", text)
    if "&" in text:
        text = html.unescape(text)
    if "\\" in text:
        text = _JOIN.sub(lambda m: m.group(1), text)
        text = _ESCAPE.sub(lambda m: _unescape(m.group(1)), text)
    return text


def _unescape(code: str) -> str:
    if code[0] in "ux":
        return chr(int(code[1:], 16))
    return {"n": " ", "r": " ", "t": " "}.get(code, code)


def _base64_texts(text: str) -> Iterator[tuple[str, int]]:
    """(decoded text, line) of each base64 run of `text` that decodes to UTF-8 text."""
    for m in _BASE64.finditer(text):
        run = re.sub(r"\s+", "", m.group())
        try:
            decoded = base64.b64decode(run + "=" * (-len(run) % 4), validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            continue
        yield decoded, text.count("\n", 0, m.start()) + 1


class Scanned:
    """A text's readings, made once for all the bodies searched in it: as written, decoded
    (`_decoded`) and each base64 run decoded."""

    def __init__(self, text: str):
        readings = [(text, 0)]
        if (decoded := _decoded(text)) != text:
            readings.append((decoded, 0))
        for reading, _ in list(readings):
            for run, line in _base64_texts(reading):
                readings += [(run, line)] + ([(d, line)] if (d := _decoded(run)) != run else [])
        self.views = []
        for reading, line in readings:
            toks, lines = _tokens(reading)
            self.views.append(_View(toks, [line] * len(toks) if line else lines))


def find_leaks(bodies: Iterable[Body], files: Mapping[str, str | bytes],
               cache: dict | None = None) -> list[Leak]:
    """Every place in `files` that holds a copy of one of `bodies`: text files, archive
    members (`archive.zip!member`) and the printable runs of other binaries. `cache` (a dict
    kept across calls with the same bodies, as for the commits of one history) remembers
    what each content held."""
    bodies = list(bodies)
    leaks = []
    if not bodies:
        return leaks
    for path, content in sorted(files.items()):
        key = hashlib.sha1(content if isinstance(content, bytes) else content.encode()).digest()
        found = cache.get(key) if cache is not None else None
        if found is None:
            found = [(where[len(path):], line, body.name)
                     for where, text in texts(path, content)
                     for scanned in [Scanned(text)] for body in bodies
                     if (line := body.find(scanned)) is not None]
            if cache is not None:
                cache[key] = found
        leaks += [Leak(path + suffix, line, name) for suffix, line, name in found]
    return leaks
