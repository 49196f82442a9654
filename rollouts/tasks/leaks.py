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
import urllib.parse
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

import numpy as np

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
# A copy of a git repository under another name (`backup.git`, `.git.bak`): its objects hold
# every version; so do git's packs, their indexes and bundles, under any name.
_GIT_DIR = re.compile(r"^(.+\.git|\.git[-._~].*)$")
_GIT_DATA = (b"PACK\x00\x00\x00", b"\xfftOc", b"# v2 git bundle", b"# v3 git bundle")
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
# A tag names itself right after "<" (so `a < b > c` is not one); comments too.
_TAG = re.compile(r"<!--.*?-->|</?([A-Za-z][\w:-]*)(?:\s[^<>]*)?/?>", re.DOTALL)
# Tags inside a line of rendered code (Pygments, coverage, pydoc): they may split a token.
_INLINE = {"span", "a", "b", "i", "em", "strong", "code", "tt", "font", "mark", "var", "kbd",
           "samp", "small", "big", "u", "s", "sub", "sup", "wbr", "ins", "del"}
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")
# Backslash escapes of strings (\n, \", \uXXXX, \xNN) and of Markdown/LaTeX (\_, \*, ...).
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[nrt\"'\\/_*`#\[\](){}<>|~.!+-])")
_COMMENT = re.compile(r"#[^\n]*")
_LINE_NUMBER = re.compile(r"(?m)^[ \t]*\d+[ \t]*[|:]?(?=[ \t]|$)")
# Where one quoted line ends and the next begins: notebooks' JSON lists, .po files, C strings.
_JOIN = re.compile(r"(?:\\n)?\"[ \t]*,?[ \t]*(\r?\n)[ \t]*\"")
_BASE64 = re.compile(r"[A-Za-z0-9+/]{24,}={0,2}(?:[ \t]*\r?\n[ \t]*[A-Za-z0-9+/]{4,}={0,2})*")
_PRINTABLE_RUNS = re.compile(rb"[^\t\n\r\x20-\x7e]+")
# Statement separators, line continuations and trailing commas formatters add or remove.
_DROPPED = {";", "\\"}
_QUOTES = {"'": '"', "`": '"'}
_NEWLINE = re.compile("\n")
_CLOSING = {")", "]", "}"}
_KEEP = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


def generated(path: str, content: str | bytes | None = None) -> bool:
    """Whether `path` (relative, POSIX) is a generated or cached artefact, not a source; with
    its `content`, also bytecode under any name and an archive holding an artefact (a zip of
    `__pycache__`, a source distribution: a tarball with PKG-INFO)."""
    parts = PurePosixPath(path).parts or ("",)
    if any(p in _GENERATED_DIRS or p.endswith((".egg-info", ".dist-info")) or _GIT_DIR.match(p)
           for p in parts[:-1]):
        return True
    if parts[-1].endswith(_GENERATED_SUFFIXES) or _GENERATED_NAMES.match(parts[-1]):
        return True
    return isinstance(content, bytes) and _artefact_content(content)


def _artefact_content(data: bytes, depth: int = 0) -> bool:
    """Bytecode, git's packed data, or an archive (ARCHIVE_DEPTH levels) holding an artefact
    or a PKG-INFO."""
    if _is_bytecode(data) or data.startswith(_GIT_DATA):
        return True
    members = _members(data) if depth < ARCHIVE_DEPTH else None
    return members is not None and any(
        generated(name) or PurePosixPath(name).name == "PKG-INFO"
        or _artefact_content(blob, depth + 1) for name, blob in members)


def _is_bytecode(data: bytes) -> bool:
    """A .pyc header: a two-byte magic number of CPython 3 (or 2) followed by \\r\\n."""
    magic = int.from_bytes(data[:2], "little")
    return len(data) >= 8 and data[2:4] == b"\r\n" and (3000 <= magic < 4000 or 20000 <= magic < 63000)


def _members(data: bytes) -> list[tuple[str, bytes]] | None:
    """An archive's files as (name, bytes) (a compressed single file or a zlib stream is one
    member named ''), or None if `data` is not an archive; at most ARCHIVE_BYTES in all."""
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
    if data[:1] == b"x" and int.from_bytes(data[:2], "big") % 31 == 0:  # a zlib stream
        try:  # (git's loose objects: "blob SIZE\0" and the content)
            return [("", zlib.decompressobj().decompress(data, ARCHIVE_BYTES))]
        except zlib.error:
            return None
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


def _tokens(text: str) -> tuple[list[str], np.ndarray]:
    """Normalised tokens of `text` and the line each starts on: one kind of quote, no
    statement separators, line continuations or trailing commas."""
    toks, starts = [], []
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok in _DROPPED:
            continue
        if tok in _CLOSING and toks and toks[-1] == ",":
            toks.pop()
            starts.pop()
        toks.append(_QUOTES.get(tok, tok))
        starts.append(m.start())
    newlines = [m.start() for m in _NEWLINE.finditer(text)]
    return toks, np.searchsorted(np.asarray(newlines, np.int64), starts).astype(np.int32) + 1


def _words(toks: list[str]) -> list[str]:
    return [t for t in toks if _WORD.match(t)]


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


# Polynomial hashing of token runs, modulo 2**64 (numpy's unsigned arithmetic wraps): an odd
# base is invertible, so the hash of any run is a difference of prefix sums.
_BASE = 0x9E3779B97F4A7C15
_BASE_INV = pow(_BASE, -1, 1 << 64)


def _powers(base: int, n: int) -> np.ndarray:
    p = np.full(n, base, np.uint64)
    p[:1] = 1
    return np.cumprod(p, dtype=np.uint64)


class _Runs:
    """The hash of every run of a token stream: run i..i+L-1 hashes to
    B^(i+L-1) * (S[i+L] - S[i]), S the prefix sums of id_j * B^-j."""

    def __init__(self, toks: Sequence[str]):
        ids = np.fromiter((hash(t) for t in toks), np.int64, len(toks)).view(np.uint64)
        self.n = len(ids)
        self._sums = np.concatenate([np.zeros(1, np.uint64),
                                     np.cumsum(ids * _powers(_BASE_INV, self.n), dtype=np.uint64)])
        self._runs: dict[int, np.ndarray] = {}

    def of_length(self, length: int) -> np.ndarray:
        """[n - length + 1] hashes of the runs of `length` tokens, by start."""
        if length not in self._runs:
            if length > self.n:
                self._runs[length] = np.zeros(0, np.uint64)
            else:
                s = self._sums
                self._runs[length] = _powers(_BASE, self.n)[length - 1:] * (s[length:] - s[:-length])
        return self._runs[length]


def _patterns(toks: Sequence[str], window: int | None) -> dict[int, np.ndarray]:
    """length -> hashes: every run of `window` tokens, or the whole stream if `window` is
    None or longer than it."""
    runs = _Runs(toks)
    length = len(toks) if window is None else min(window, len(toks))
    return {length: np.unique(runs.of_length(length))}


def _merge(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    return {n: np.union1d(a.get(n, np.zeros(0, np.uint64)), b.get(n, np.zeros(0, np.uint64)))
            for n in a.keys() | b.keys()}


@dataclass(frozen=True)
class Leak:
    path: str
    line: int
    name: str  # the deleted function whose body it copies

    def __str__(self) -> str:
        return f"{self.path}:{self.line} holds a copy of the deleted body of {self.name}"


class Body:
    """The token patterns of one deleted body (as written and without its comments): every
    run of WINDOW tokens (the whole body when shorter) and of WINDOW words, and the whole body
    renamed; each as hashes by length."""

    def __init__(self, name: str, source: str):
        self.name = name
        self.lines = sum(1 for line in source.splitlines() if line.strip())  # of code, for stats
        self.patterns: dict[str, dict[int, np.ndarray]] = {"exact": {}, "words": {}, "renamed": {}}
        for text in {source, _without_comments(source)}:
            toks, _ = _tokens(text)
            words = _words(toks)
            for kind, stream, window, least in (("exact", toks, WINDOW, MIN_TOKENS),
                                                ("words", words, WINDOW, WINDOW),
                                                ("renamed", _renamed(toks), None, MIN_RENAMED)):
                if len(stream) >= least:
                    self.patterns[kind] = _merge(self.patterns[kind], _patterns(stream, window))

    def find(self, text: str | Scanned) -> int | None:
        """The line where the first copy starts in `text`, or None."""
        scanned = text if isinstance(text, Scanned) else Scanned(text)
        for view in scanned.views:
            found = [line for kind, patterns in self.patterns.items()
                     if patterns and (line := view.find(kind, patterns)) is not None]
            if found:
                return min(found)
        return None


class _View:
    """One reading of a text: the runs of its tokens, of its words and of its renamed tokens
    (hashed on first use), and the line each token starts on."""

    def __init__(self, toks: list[str], lines: np.ndarray):
        self._toks = toks
        self._lines = {"exact": lines, "renamed": lines}
        self._runs: dict[str, _Runs] = {}

    def _stream(self, kind: str) -> _Runs:
        if kind not in self._runs:
            toks = self._toks
            if kind == "words":
                keep = [i for i, t in enumerate(toks) if _WORD.match(t)]
                self._lines["words"] = self._lines["exact"][np.asarray(keep, np.int64)]
                toks = [toks[i] for i in keep]
            self._runs[kind] = _Runs(_renamed(toks) if kind == "renamed" else toks)
        return self._runs[kind]

    def find(self, kind: str, patterns: dict[int, np.ndarray]) -> int | None:
        """The line of the earliest run of `kind` tokens whose hash is one of `patterns`."""
        runs = self._stream(kind)
        starts = [int(hits[0]) for length, hashes in patterns.items()
                  if (hits := np.flatnonzero(np.isin(runs.of_length(length), hashes))).size]
        return int(self._lines[kind][min(starts)]) if starts else None


def _decoded(text: str, tags: bool) -> str:
    """`text` with (if `tags`) HTML tags stripped (inline ones joined, others a space, their
    line breaks kept), entities and %XX unescaped, quoted lines joined and backslash escapes
    undone (line breaks as spaces: line numbers hold)."""
    if tags and "<" in text:
        text = _TAG.sub(_untag, text)
    if "&" in text:
        text = html.unescape(text)
    if _PERCENT.search(text):
        text = urllib.parse.unquote(text)
    if "\\" in text:
        text = _JOIN.sub(lambda m: m.group(1), text)
        text = _ESCAPE.sub(lambda m: _unescape(m.group(1)), text)
    return text


def _untag(m: re.Match) -> str:
    breaks = "\n" * m.group().count("\n")
    return breaks or ("" if (m.group(1) or "").lower() in _INLINE else " ")


def _unescape(code: str) -> str:
    if code[0] in "ux" and len(code) > 1:
        return chr(int(code[1:], 16))
    return {"n": " ", "r": " ", "t": " "}.get(code, code)


def _bare(text: str) -> str:
    """`text` without `#` comments and without the line numbers of a numbered listing."""
    return _LINE_NUMBER.sub("", _COMMENT.sub("", text))


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
    (`_decoded`: escapes, then also HTML tags), decoded and bare (`_bare`: a copy with
    comments added, or a numbered listing), and each base64 run decoded."""

    def __init__(self, text: str):
        decoded = [_decoded(text, tags=False), _decoded(text, tags=True)]
        readings = [(t, 0) for t in dict.fromkeys([text, *decoded, _bare(decoded[-1])])]
        for reading, _ in list(readings):
            for run, line in _base64_texts(reading):
                readings += [(t, line) for t in dict.fromkeys([run, _decoded(run, tags=True)])]
        self.views = []
        for reading, line in readings:
            toks, lines = _tokens(reading)
            self.views.append(_View(toks, np.full(len(toks), line, np.int32) if line else lines))


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
