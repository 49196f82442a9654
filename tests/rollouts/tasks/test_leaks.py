"""Feature deletion leaks nothing: generated copies dropped, other copies found, binaries kept."""

from __future__ import annotations

import base64
import bz2
import gzip
import hashlib
import html
import io
import json
import lzma
import pickle
import random
import re
import subprocess
import tarfile
import textwrap
import urllib.parse
import zipfile
import zlib
from pathlib import Path

import pytest

from rollouts.tasks import leaks
from rollouts.tasks.deletion import Target, load_deletion_task, make_deletion_tasks
from rollouts.tasks.embedded import git
from rollouts.tasks.leaks import (
    _BASE,
    REVEAL_SHARE,
    Body,
    Leak,
    Readings,
    _Runs,
    find_leaks,
    generated,
)

AREA_BODY = '''    if width < 0 or height < 0:
        raise ValueError("negative side")
    return round(width * height, ndigits)
'''
AREA = f'''def area(width, height, ndigits=3):
    """Area of a rectangle, rounded."""
{AREA_BODY}'''
PERIMETER = '''def perimeter(width, height):
    """Perimeter of a rectangle."""
    total = 0
    for side in (width, height, width, height):
        total = total + abs(side)
    return total
'''
VOLUME = '''def volume(width, height, depth):
    """Volume of a box."""
    base = area(width, height)
    scaled = [base for _ in range(int(depth))]
    return sum(scaled) + base * (depth - int(depth))
'''
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3


def test_generated_paths():
    for path in ["build/lib/geom/area.py", "geom/__pycache__/area.cpython-311.pyc",
                 "docs/_build/html/_modules/geom/area.html", "htmlcov/geom_area_py.html",
                 "geom/area.py.orig", "geom/area.py.rej", "geom/area.py.bak", ".coverage",
                 ".coverage.host.123", "geom.egg-info/SOURCES.txt", ".tox/py311/x.py",
                 ".mypy_cache/3.11/geom/area.data.json", "site/index.html", "dist/geom.whl",
                 ".pytest_cache/v/cache/lastfailed", "nb/.ipynb_checkpoints/a.ipynb"]:
        assert generated(path), path
    for path in ["geom/area.py", "geom/build_tools.py", "docs/conf.py", "tests/data/logo.png",
                 "geom/site_config.py", "README.md"]:
        assert not generated(path), path


def test_copies_are_found_however_they_are_dressed():
    body = Body("geom/area.py::area", AREA_BODY)
    reformatted = ("def other(width,height,ndigits=3):\n  if (width<0 or height<0):\n"
                   "      raise ValueError( 'negative side' )\n  return round(width*height,\n"
                   "    ndigits)\n").replace("'", '"')
    spans = "".join(f'<span class="n">{html.escape(t)}</span> ' for t in AREA_BODY.split())
    rendered = f"<html><body>\n<pre>\n{spans}\n</pre></body></html>"
    renamed = PERIMETER.replace("total", "acc").replace("side", "s").replace("width", "w")
    files = {"a.py": "x = 1\n" + reformatted, "b.html": rendered, "c.py": "import os\n",
             "d.py": renamed, "e.bin": b"\x00\xff" + AREA_BODY.encode()}
    leaks = find_leaks([body, Body("perimeter", PERIMETER.split('"""\n', 1)[1])], files)
    assert [(leak.path, leak.line, leak.name) for leak in leaks] == [
        ("a.py", 3, "geom/area.py::area"), ("b.html", 3, "geom/area.py::area"),
        ("d.py", 3, "perimeter"), ("e.bin", 1, "geom/area.py::area")]


def test_run_hashes_match_the_polynomial_they_stand_for():
    """_Runs' prefix-sum hashes against the polynomial sum of the token ids, mod 2**64."""
    rng = random.Random(7)
    toks = [rng.choice(["a", "b", "c", "(", ")", "x1", "return"]) for _ in range(203)]
    runs = _Runs(toks)
    for length in (1, 5, 13, 17, 203):
        want = [sum((hash(t) % (1 << 64)) * pow(_BASE, length - 1 - j, 1 << 64)
                    for j, t in enumerate(toks[i:i + length])) % (1 << 64)
                for i in range(len(toks) - length + 1)]
        assert runs.of_length(length).tolist() == want
        seen = {}  # the same run, the same hash; different runs, different hashes
        for i, h in enumerate(want):
            assert seen.setdefault(h, tuple(toks[i:i + length])) == tuple(toks[i:i + length])
    assert runs.of_length(204).size == 0


def test_short_and_unrelated_bodies_are_not_copies():
    assert find_leaks([Body("f", "    return x\n")], {"a.py": "def g(x):\n    return x\n"}) == []
    # a constructor's shape is every constructor's: renamed, it is not evidence
    fields = ["width", "height", "depth", "colour", "label", "weight"]
    init = "".join(f"        self.{f} = {f}\n" for f in fields)
    other = "".join(f"        self.{f}_ = {f}_value\n" for f in ["a", "b", "c", "d", "e", "f"])
    assert find_leaks([Body("Box.__init__", init)], {"point.py": other}) == []
    assert find_leaks([Body("Box.__init__", init)], {"copy.py": init.replace("        ", "  ")})
    body = Body("area", AREA_BODY)
    assert find_leaks([body], {"a.py": "if width < 0:\n    raise ValueError('x')\n"}) == []


# A body with a comment, a string and enough words for every reading (words, renamed).
SPLIT_BODY = """    # walk the text once, cutting at each separator outside brackets
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in '([{':
            depth += 1
        elif char in ')]}':
            depth -= 1
        elif char == sep and depth == 0:
            parts.append(text[start:index].strip())
            start = index + 1
    parts.append(text[start:].strip())
    return parts
"""
SPLIT_CODE = [line for line in SPLIT_BODY.splitlines() if not line.lstrip().startswith("#")]


def _archive(kind: str, members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for name, data in members.items():
                z.writestr(name, data)
    else:
        with tarfile.open(fileobj=buf, mode=f"w:{kind}") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _spans(line: str) -> str:
    """A line as a highlighter renders it: each token in a span, escaped, the first
    identifier split over two spans."""
    out = re.sub(r"\w+|[^\w\s]+", lambda m: f'<span class="x">{html.escape(m.group())}</span>', line)
    return re.sub(r'<span class="x">(\w)(\w+)</span>', r'<span class="x">\1</span><span>\2</span>', out, count=1)


def _dressed_copies() -> dict[str, str | bytes]:
    """One file per way a copy can be dressed (each must be found)."""
    code = "\n".join(SPLIT_CODE) + "\n"
    notebook = {"cells": [{"cell_type": "code", "source": [line + "\n" for line in SPLIT_CODE],
                           "outputs": []}], "nbformat": 4}
    rendered = {"cells": [{"cell_type": "code", "source": ["import inspect\n"], "outputs": [
        {"data": {"text/html": [f"<pre>{html.escape(line)}</pre>\n" for line in SPLIT_CODE]}}]}]}
    return {
        "comment.py": "".join(f"# {line}\n" for line in SPLIT_CODE),
        "doctest.py": '"""\n>>> def f(text, sep):\n' + "".join(f"...     {line.strip()}\n"
                                                         for line in SPLIT_CODE) + '"""\n',
        "nb.ipynb": json.dumps(notebook, indent=1),
        "out.ipynb": json.dumps(rendered, indent=1),
        "msgs.po": 'msgid ""\n' + "".join(f'"{line}\\n"\n' for line in SPLIT_CODE),
        "notes.md": "Like this:\n\n```python\n" + code + "```\n",
        "fix.patch": "--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,12 @@\n" + "".join(
            f"+{line}\n" for line in SPLIT_CODE),
        # renamed, one statement a line where Python allows it, no spaces
        "minified.py": ("def f(a,b):\n c,d,e=[],0,0\n for g,h in enumerate(a):\n"
                        "  if h in'([{':d+=1\n  elif h in')]}':d-=1\n"
                        "  elif h==b and d==0:c.append(a[e:g].strip());e=g+1\n"
                        " c.append(a[e:].strip());return c\n"),
        "black.py": code.replace("'([{'", '"([{"').replace("')]}'", '")]}"').replace(
            "parts.append(text[start:].strip())", "parts.append(\n        text[start:].strip(),\n    )"),
        "literal.py": "SNIPPET = " + json.dumps(code) + "\n",
        "hex.js": "var s = '" + "".join(f"\\x{ord(ch):02x}" for ch in code) + "';\n",
        "blob.txt": "data:\n" + "\n".join(textwrap.wrap(base64.b64encode(code.encode()).decode(), 76)) + "\n",
        "bundle.zip": _archive("zip", {"pkg/split.py": code.encode()}),
        "sdist.tar.gz": _archive("gz", {"x-1.0/src/split.py": code.encode()}),
        "nested.tar.xz": _archive("xz", {"inner.zip": _archive("zip", {"s.py": code.encode()})}),
        "single.gz": gzip.compress(code.encode()),
        # coverage.py-style page: numbered lines, every token in its own span, one split
        "report.html": "".join(
            f'<p class="pln"><span class="n"><a id="t{n}" href="#t{n}">{n}</a></span>'
            f'<span class="t">{_spans(line)}&nbsp;</span></p>\n'
            for n, line in enumerate(SPLIT_CODE, 1)),
        "numbered.txt": "".join(f"{n:6}\t{line}\n" for n, line in enumerate(SPLIT_CODE, 1)),
        "commented.py": "def f(text, sep):\n" + "".join(
            f"{line}  # step {n}\n" for n, line in enumerate(SPLIT_CODE)),
        "link.md": "[run it](https://play.example/?code=" + urllib.parse.quote(code) + ")\n",
        "escaped.md": code.replace("[", "\\[").replace("]", "\\]").replace("*", "\\*"),
        # a git loose object (zlib) and a repository copied under another name's objects
        "objects/ab/cdef01": zlib.compress(b"blob %d\0" % len(code) + code.encode()),
        "lines.py": "LINES = " + repr([line + "\n" for line in SPLIT_CODE]) + "\n",
        # a zero-width space or soft hyphen inside every word; every word split over two tspans
        "invisible.txt": re.sub(r"\b(\w)(\w+)", lambda m: m[1] + "\u200b\u00ad" + m[2], code),
        "slide.svg": "<svg>" + "".join(
            "<text>" + re.sub(r"\b(\w)(\w+)", r"<tspan>\1</tspan><tspan>\2</tspan>",
                              html.escape(line)) + "</text>\n" for line in SPLIT_CODE) + "</svg>",
        "utf16.txt": code.encode("utf-16"), "utf16le.txt": code.encode("utf-16-le"),
        "utf32.txt": code.encode("utf-32"),
        "db.sqlite": b"SQLite format 3\x00\x10\x00" + bytes(100) + code.encode() + b"\x00\x07",
    }


def test_every_dressing_of_a_copy_is_found():
    body = Body("split", SPLIT_BODY)
    files = _dressed_copies()
    found = {leak.path for leak in find_leaks([body], files)}
    assert found == set(files)
    # as renamed or reformatted, the copy without its comment still matches the body with it
    assert Body("split", "\n".join(SPLIT_CODE)).find(SPLIT_BODY) == 2
    where = {leak.path + leak.member: leak.line for leak in find_leaks([body], files)}
    assert where["notes.md"] == 4 and where["bundle.zip!pkg/split.py"] == 1
    assert where["nested.tar.xz!inner.zip!s.py"] == 1 and where["blob.txt"] == 2
    (zipped,) = find_leaks([body], {"bundle.zip": files["bundle.zip"]})
    assert str(zipped) == "bundle.zip!pkg/split.py:1 holds a copy of the deleted body of split"
    assert where["report.html"] == 1 and where["numbered.txt"] == 1
    # Markdown escapes inside identifiers (`total\_sum`)
    mean = ("    total_sum = 0\n    for item_value in values:\n"
            "        total_sum += item_value * weight_of(item_value)\n"
            "    return total_sum / len(values)\n")
    assert Body("mean", mean).find("Written out:\n\n" + mean.replace("_", "\\_")) == 3


def test_a_copy_reveals_the_body_and_a_shared_idiom_does_not():
    """A place counts as a copy when it reveals half the body's words or REVEAL_WORDS of them;
    a loop header and the line after it, shared with other code, reveal neither."""
    body = Body("split", SPLIT_BODY)
    idiom = "\n".join(SPLIT_CODE[1:3]) + "\n            pass\n"  # for ...: / if char in '([{':
    assert body.find(idiom) is None and 0 < body.share(idiom) < REVEAL_SHARE
    # twice in one file, with other code between: two idioms, not one copy
    twice = (f"def a(text):\n{idiom}    return 1\n\n\ndef b(text, sep):\n"
             f"    \"\"\"Another.\"\"\"\n{idiom}    return 2\n")
    assert find_leaks([body], {"two.py": twice, "nb.md": f"```\n{idiom}```\n"}) == []
    # several lines of it: a copy, wherever and however it is written
    part = "\n".join(SPLIT_CODE[1:8]) + "\n"
    assert [leak.path for leak in find_leaks([body], {
        "part.py": part, "part.md": "".join(f"> {line}\n" for line in part.splitlines()),
        "idiom.py": idiom})] == ["part.md", "part.py"]
    # a whole copy with one token changed in the middle: its two halves (each under the
    # thresholds alone) are one place
    changed = "\n".join(SPLIT_CODE).replace("elif char == sep", "if char == sep")
    assert find_leaks([body], {"changed.py": changed}) == [Leak("changed.py", 1, "split")]


def test_readings_kept_across_bodies_find_what_fresh_ones_do():
    files = {**_dressed_copies(), "area.py": AREA, "perimeter.html": html.escape(PERIMETER)}
    bodies = [[Body("split", SPLIT_BODY)], [Body("area", AREA_BODY)],
              [Body("perimeter", PERIMETER.split('"""\n', 1)[1]), Body("split", SPLIT_BODY)]]
    kept, small = Readings(), Readings(budget=100)  # small: keeps nothing
    for some in bodies:
        want = find_leaks(some, files)
        assert want and find_leaks(some, files, readings=kept) == want
        assert find_leaks(some, files, readings=small) == want
    assert len(kept._kept) == len(files) and not small._kept


def test_a_content_over_the_budget_is_read_once_for_every_anticipated_body(monkeypatch):
    """A file whose text is over the readings budget (here a gzipped trace, small as bytes) is
    read once, for every body a run anticipates; only where each was found is kept, and that
    finds what fresh readings do. A body not anticipated has it read again."""
    reads, real = [], leaks.texts

    def counted(path, content, depth=0):
        if depth == 0:  # a file, not an archive's member
            reads.append(path)
        return real(path, content, depth)

    monkeypatch.setattr(leaks, "texts", counted)
    rng = random.Random(5)
    rows = "".join(f'{{"ts": {rng.randrange(10**9)}, "dur": {rng.random():.6f}}},\n'
                   for _ in range(1500))
    trace = rows + "\n".join(SPLIT_CODE) + "\n" + rows
    files = {"trace.json.gz": gzip.compress(trace.encode()), "area.py": AREA, "notes.md": PERIMETER}
    area, split = Body("area", AREA_BODY), Body("split", SPLIT_BODY)
    perimeter = Body("perimeter", PERIMETER.split('"""\n', 1)[1])
    volume = Body("volume", VOLUME.split('"""\n', 1)[1])
    budget = len(trace) - 1
    assert len(files["trace.json.gz"]) < budget  # charged by its text, not its bytes
    readings = Readings(budget=budget, anticipated=lambda: [area, split, perimeter, volume])
    for feature in ([split], [area], [perimeter, split], [volume]):
        want = find_leaks(feature, files)
        reads.clear()
        assert find_leaks(feature, files, readings=readings) == want
        assert sorted(reads) == ([] if feature != [split] else sorted(files)), feature
    assert find_leaks([split], files) == [Leak("trace.json.gz", 1501, "split", "!")]
    assert set(readings._kept) == {hashlib.sha1(files[p].encode()).digest() for p in ("area.py", "notes.md")}
    moved = Body("split as it once was", SPLIT_BODY.replace("depth", "level"))
    want = find_leaks([moved], files)
    reads.clear()
    assert find_leaks([moved], files, readings=readings) == want
    assert reads == ["trace.json.gz"]


def test_a_long_text_read_in_pieces_finds_what_a_whole_reading_does(monkeypatch):
    """Pieces overlap, so a copy across a cut is found whole; lines count from the text's start;
    a text without line breaks (minified) is cut mid-line."""
    body = Body("split", SPLIT_BODY)
    rng = random.Random(7)
    filler = [f"row_{i} = {rng.randrange(10**6)}" for i in range(400)]
    copy = "\n".join(SPLIT_CODE)
    for at in (5, 150, 280, 395):
        text = "\n".join(filler[:at] + [copy] + filler[at:])
        files = {"big.py": text, "one_line.js": text.replace("\n", " ; ")}
        whole = find_leaks([body], files)
        assert [leak.line for leak in whole] == [at + 1, 1]
        monkeypatch.setattr(leaks, "PIECE", 1000)
        monkeypatch.setattr(leaks, "PIECE_OVERLAP", 800)
        pieces = list(leaks._pieces(text))
        assert len(pieces) > 3 and pieces[0][1].startswith("row_0")
        assert find_leaks([body], files) == whole, at
        monkeypatch.undo()


def test_compressed_files_are_read_to_the_archive_limit_only(monkeypatch):
    monkeypatch.setattr(leaks, "ARCHIVE_BYTES", 1000)
    text = "".join(f"x{i} = {i}\n" for i in range(5000)).encode()
    for module in (gzip, bz2, lzma):
        assert leaks._members(module.compress(text)) == [("", text[:1000])], module


def test_readings_do_not_invent_copies():
    body = Body("split", SPLIT_BODY)
    unrelated = {
        "other.py": "def join(parts, sep):\n    out = []\n    for part in parts:\n"
                    "        out.append(part.strip())\n    return sep.join(out)\n",
        "logo.png": PNG, "words.txt": " ".join(["parts depth start index char text"] * 2),
        "notes.ipynb": json.dumps({"cells": [{"source": ["for index, char in enumerate(text):\n"]}]}),
        "key.txt": base64.b64encode(bytes(range(256))).decode(),
        "data.zip": _archive("zip", {"a.csv": b"1,2,3\n", "b.bin": bytes(range(256))}),
        "listing.txt": "".join(f"{n:4} | for index, char in x\n" for n in range(40)),
    }
    assert find_leaks([body], unrelated) == []


def test_archives_of_artefacts_and_bytecode_are_generated():
    code = "\n".join(SPLIT_CODE).encode()
    pyc = b"\xa7\r\r\n" + bytes(12) + b"\xe3" + code
    assert generated("x/cached.bin", pyc) and not generated("x/cached.bin", PNG)
    assert generated("libs/pkg.zip", _archive("zip", {"pkg/__pycache__/m.cpython-311.pyc": pyc}))
    assert generated("vendor/x-1.0.tar.gz", _archive("gz", {"x-1.0/PKG-INFO": b"Name: x\n",
                                                            "x-1.0/x.py": code}))
    assert generated("docs.zip", _archive("zip", {"_build/html/index.html": b"<p>hi</p>"}))
    assert generated("x.gz", gzip.compress(pyc)) and not generated("x.gz", gzip.compress(code))
    py2 = (62211).to_bytes(2, "little") + b"\r\n" + bytes(4) + b"c" + code
    assert generated("old/cache.bin", py2)
    for git_data in [b"PACK\x00\x00\x00\x02" + bytes(20), b"\xfftOc\x00\x00\x00\x02",
                     b"# v2 git bundle\n" + bytes(40)]:
        assert generated("fixtures/history.dat", git_data)
    assert generated("backup.git/objects/ab/cdef", b"x") and generated(".git.bak/HEAD")
    assert not generated(".github/workflows/ci.yml") and not generated(".gitignore")
    # rendered by a tool that says so, under any name; a pickled function (its bytecode)
    assert generated("src/geom/_area.c", "/* Generated by Cython 3.0.10 */\n" + "\n".join(SPLIT_CODE))
    assert generated("docs/area.html", '<html><head><title>Coverage for geom/area.py: 100%</title>')
    assert generated("docs/area.html", "<html>\n<!-- generated by Pygments <https://pygments.org/> -->")
    assert not generated("README.md", "Coverage for each module: https://coverage.readthedocs.io\n")
    pickled = b"\x80\x05\x95\xbb\x01\x8c\x17cloudpickle.cloudpickle\x94\x8c\r_builtin_type\x94\x8c\x08CodeType"
    assert generated("tests/data/model.pkl", pickled + code)
    assert not generated("tests/data/table.pkl", pickle.dumps({"a": [1, 2, 3]}))
    for path in ["docs/html/_modules/geom/area.html", "docs/html/_sources/index.rst.txt",
                 "geom/area.py.old", "geom/area.py.tmp"]:
        assert generated(path), path
    assert not generated("tests/data/fixture.zip", _archive("zip", {"a.csv": b"1,2\n"}))
    for path in [".svn/pristine/ab/abcd.svn-base", ".hg/store/data/x.i", ".idea/shelf/x.patch",
                 "lib/python3.11/site-packages/geom/area.py", "geom/area.py,cover",
                 "geom/area.py.cover", "dist.egg", "app.pyz", "coverage.json", "lcov.info"]:
        assert generated(path), path


def _commit(repo: Path, message: str, files: dict[str, str | bytes], remove=()):
    for path in remove:
        (repo / path).unlink()
    for path, content in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes(content if isinstance(content, bytes) else content.encode())
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


TEXT = f"""def split(text, sep):
    \"\"\"Split at `sep` outside brackets.\"\"\"
{SPLIT_BODY}"""
TEXT_TESTS = """from geom.text import split


def test_split():
    assert split("a, f(b, c), d", ",") == ["a", "f(b, c)", "d"]
"""


@pytest.fixture(scope="module")
def leaky(tmp_path_factory):
    """A repository with every kind of leftover copy (build copies, rendered docs, coverage
    HTML, patch leftovers, bytecode under any name, archived bytecode, a vendored duplicate, a
    notebook's output, a commit message, other refs), binary assets and a moved function."""
    root = tmp_path_factory.mktemp("leaky")
    repo = root / "geom"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    tests = ("from geom.shapes import area, perimeter, volume\n\n\n"
             "def test_area():\n    assert area(2, 3.5) == 7.0\n\n\n"
             "def test_perimeter():\n    assert perimeter(2, 3) == 10\n\n\n"
             "def test_volume():\n    assert volume(2, 3, 2) == 12\n")
    assets = ("from pathlib import Path\n\n\ndef test_logo_is_a_png():\n"
              "    data = (Path(__file__).parent / 'data' / 'logo.png').read_bytes()\n"
              f"    assert data == {PNG!r}\n")
    vendored = ("from geom.vendor.copy import _perimeter\n\n\n"
                "def test_vendored():\n    assert _perimeter(1, 2) == 6\n")
    # The first commit keeps volume in geom/old.py: the history holds a copy under another name.
    _commit(repo, "start", {"geom/__init__.py": "", "geom/old.py": "from geom.shapes import area\n\n\n" + VOLUME,
                            "geom/shapes.py": AREA + "\n\n" + PERIMETER + "\n\nfrom geom.old import volume\n",
                            "tests/test_shapes.py": tests, "README.md": "geom\n"})
    rendered = "".join(f'<span class="n">{html.escape(line)}</span>\n' for line in AREA.splitlines())
    notebook = {"cells": [{"cell_type": "code", "source": ["import inspect, geom.text\n",
                                                           "inspect.getsource(geom.text.split)"],
                           "outputs": [{"data": {"text/html": [
                               f"<pre>{html.escape(line)}</pre>\n" for line in TEXT.splitlines()]}}]}]}
    pyc = b"\xa7\r\r\n" + bytes(12) + b"\xe3" + AREA.encode()
    _commit(repo, "move volume; assets", {
        "geom/shapes.py": AREA + "\n\n" + PERIMETER + "\n\n" + VOLUME,
        "tests/test_assets.py": assets, "tests/data/logo.png": PNG,
        "build/lib/geom/shapes.py": AREA, "docs/_build/html/_modules/geom/shapes.html": rendered,
        "htmlcov/geom_shapes_py.html": f"<pre>{html.escape(AREA)}</pre>",
        "geom/shapes.py.orig": AREA, "geom/__pycache__/shapes.cpython-311.pyc": pyc,
        "geom/_cache.dat": pyc, "vendor/cache.zip": _archive("zip", {"__pycache__/s.pyc": pyc}),
        # a vendored duplicate of perimeter, which a test imports: deleted too
        "geom/vendor/__init__.py": "", "tests/test_vendor.py": vendored,
        "geom/vendor/copy.py": PERIMETER.replace("def perimeter", "def _perimeter"),
        "geom/text.py": TEXT, "tests/test_text.py": TEXT_TESTS,
        "docs/demo.ipynb": json.dumps(notebook, indent=1)},
        remove=["geom/old.py"])
    _commit(repo, "readme", {"README.md": "geom: shapes\n"})
    # a submodule (its commit is not in this repository: the history replays around it)
    git(repo, "update-index", "--add", "--cacheinfo", f"160000,{'12345678' * 5},ext/lib")
    git(repo, "commit", "-q", "-m", "ext/lib as a submodule")
    # Other refs hold copies of area; none of them reaches a task.
    git(repo, "checkout", "-q", "-b", "old")
    _commit(repo, "legacy", {"geom/legacy.py": AREA.replace("def area", "def legacy_area")})
    git(repo, "tag", "v0")
    git(repo, "checkout", "-q", "main")
    (repo / "README.md").write_text(AREA)
    git(repo, "stash", "-q")
    git(repo, "notes", "add", "-m", AREA)
    out = root / "out"
    features = [[Target.parse(f"geom/{spec}")] for spec in
                ["shapes.py::area", "shapes.py::perimeter", "shapes.py::volume", "text.py::split"]]
    made, skipped = make_deletion_tasks(repo, out, features=features)
    return out, made, skipped


def test_generated_copies_dropped_vendored_deleted_and_other_copies_refused(leaky):
    out, made, skipped = leaky
    assert [m.task_id for m in made] == ["geom-area", "geom-perimeter", "geom-volume"]
    vendored = made[1]
    assert [str(t) for t in vendored.feature] == ["geom/shapes.py::perimeter",
                                                  "geom/vendor/copy.py::_perimeter"]
    assert vendored.targets == ("tests/test_shapes.py::test_perimeter",
                                "tests/test_vendor.py::test_vendored")
    task = load_deletion_task(out / "geom-perimeter")
    assert "- geom/vendor/copy.py: _perimeter(width, height)" in task.prompt
    assert "raise NotImplementedError" in task.files["geom/vendor/copy.py"]
    assert find_leaks([Body("p", PERIMETER.split('"""\n', 1)[1])], task.files) == []
    (refused,) = skipped
    assert refused.startswith("geom/text.py::split: refused: docs/demo.ipynb:")


# each task's deleted body, and a piece of it to look for as plain bytes
BODIES = {"geom-area": (AREA_BODY, "ndigits)"),
          "geom-perimeter": (PERIMETER.split('"""\n', 1)[1], "abs(side)"),
          "geom-volume": (VOLUME.split('"""\n', 1)[1], "(depth - int(depth))")}


def test_task_and_history_hold_no_copy_and_keep_binaries(leaky, tmp_path):
    out, _, _ = leaky
    area = load_deletion_task(out / "geom-area")
    assert not any(generated(p, c) for p, c in area.files.items())
    assert {"geom/_cache.dat", "vendor/cache.zip"} <= set(json.loads(
        (out / "geom-area" / "task.json").read_text())["dropped"])
    assert area.files["tests/data/logo.png"] == PNG  # carried byte for byte
    for task_id, (source, piece) in BODIES.items():
        task, body = load_deletion_task(out / task_id), Body(task_id, source)
        assert find_leaks([body], task.files) == []
        clone = tmp_path / task_id
        subprocess.run(["git", "clone", "-q", task.metadata["git_source"], str(clone)], check=True)
        assert git(clone, "ls-remote", task.metadata["git_source"]).split()[1::2] == [
            "HEAD", "refs/heads/main"]  # no tag, other branch, stash or notes
        for sha in git(clone, "rev-list", "HEAD").split():
            paths = git(clone, "ls-tree", "-r", "--name-only", sha).split()
            assert not any(generated(p) for p in paths)
            text = {p: git(clone, "show", f"{sha}:{p}") for p in paths if not p.endswith(".png")}
            assert find_leaks([body], text) == [] and all(piece not in t for t in text.values())
        # every object the bundle carries, whatever points to it
        objects = subprocess.run(["git", "-C", str(clone), "cat-file", "--batch-all-objects",
                                  "--batch"], check=True, capture_output=True).stdout
        assert piece.encode() not in objects and find_leaks([body], {"objects": objects}) == []
    # volume's first home, geom/old.py, is in the history with its body deleted
    first = git(clone, "rev-list", "--max-parents=0", "HEAD").strip()
    assert "raise NotImplementedError" in git(clone, "show", f"{first}:geom/old.py")


def test_history_copies_in_functions_are_deleted_and_others_refused(tmp_path):
    from rollouts.tasks.deletion import _replay_history

    helper = "def expected(width, height, ndigits=3):\n" + AREA_BODY
    script = "width, height, ndigits = 1, 2, 3\n" + AREA_BODY.replace("    ", "", 1).replace("\n    ", "\n")
    feature, body = [Target.parse("a.py::area")], Body("a.py::area", AREA_BODY)
    replays = []
    for name, first, message in [
            # (a.py did not parse in that commit either: kept as it was, and it held no copy)
            ("helper", {"tests/old_test.py": helper, "a.py": "def area(width, height:\n"}, "tidy"),
            ("script", {"tests/old_test.py": helper, "scripts/demo.py": script}, "tidy"),
            ("message", {}, "area, as first written:\n\n" + AREA_BODY)]:
        repo, out = tmp_path / name, tmp_path / f"{name}-replay"
        repo.mkdir()
        out.mkdir()
        git(repo, "init", "-q", "-b", "main")
        _commit(repo, "start", {"a.py": AREA, **first})
        _commit(repo, message, {"README.md": "x\n", "a.py": AREA},
                remove=[p for p in first if p != "a.py"])
        replays.append((repo, out, _replay_history(repo, out, feature, [body])))
    (_, helper_out, fine), (script_repo, _, refused), (message_repo, _, told) = replays
    # a copy inside a function of an old commit: that body deleted in the replay
    assert fine is None
    first = git(helper_out, "rev-list", "--max-parents=0", "HEAD").strip()
    assert git(helper_out, "show", f"{first}:tests/old_test.py") == (
        "def expected(width, height, ndigits=3):\n    raise NotImplementedError\n")
    # a copy at module level: refused, naming the commit
    first = git(script_repo, "rev-list", "--max-parents=0", "HEAD").strip()
    assert refused == f"commit {first[:12]}: scripts/demo.py:2 holds a copy of the deleted body of a.py::area"
    # a commit message: refused
    last = git(message_repo, "rev-parse", "HEAD").strip()
    assert told == f"commit {last[:12]}: its message:3 holds a copy of the deleted body of a.py::area"


def test_tasks_check_reads_every_commit_of_a_made_history(leaky, tmp_path):
    from rollouts.check import check_tasks
    from rollouts.tasks.deletion import history_leaks

    out, _, _ = leaky
    task = load_deletion_task(out / "geom-area")
    body = Body("geom/shapes.py::area", AREA_BODY)
    assert history_leaks(task.metadata["git_source"], [body]) == []
    assert check_tasks([task], progress=False) == []
    # a history tampered with after it was made: a side branch copies the body
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", task.metadata["git_source"], str(clone)], check=True)
    git(clone, "checkout", "-q", "-b", "side")
    _commit(clone, "notes", {"notes.txt": "old version:\n" + AREA})
    bundle = tmp_path / "tampered.bundle"
    git(clone, "bundle", "create", "-q", str(bundle), "--all")
    (leak,) = history_leaks(bundle, [body])
    sha = git(clone, "rev-parse", "HEAD").strip()
    assert leak == f"commit {sha[:12]}: notes.txt:4 holds a copy of the deleted body of {body.name}"


def test_shipped_tasks_hold_no_copy():
    import json

    from rollouts.tasks.deletion import deleted_bodies

    shipped = Path(__file__).resolve().parents[3] / "rollouts" / "tasks" / "data" / "textkit_tasks"
    dirs = sorted(p for p in shipped.iterdir() if (p / "task.json").exists())
    assert dirs
    for d in dirs:
        task = load_deletion_task(d)
        feature = [Target.parse(f) for f in task.metadata["feature"]]
        bodies = deleted_bodies(json.loads(task.metadata["reference"]), feature)
        assert bodies and find_leaks(bodies, {**task.files, "prompt": task.prompt}) == [], d.name
