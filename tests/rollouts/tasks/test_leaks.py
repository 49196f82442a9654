"""Feature deletion leaks nothing: generated copies dropped, other copies found, binaries kept."""

from __future__ import annotations

import html
import subprocess
from pathlib import Path

import pytest

from rollouts.tasks.deletion import Target, load_deletion_task, make_deletion_tasks
from rollouts.tasks.embedded import git
from rollouts.tasks.leaks import Body, find_leaks, generated

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
             "d.py": renamed, "e.bin": AREA_BODY.encode()}
    leaks = find_leaks([body, Body("perimeter", PERIMETER.split('"""\n', 1)[1])], files)
    assert [(leak.path, leak.line, leak.name) for leak in leaks] == [
        ("a.py", 3, "geom/area.py::area"), ("b.html", 3, "geom/area.py::area"),
        ("d.py", 3, "perimeter")]


def test_short_and_unrelated_bodies_are_not_copies():
    assert find_leaks([Body("f", "    return x\n")], {"a.py": "def g(x):\n    return x\n"}) == []
    body = Body("area", AREA_BODY)
    assert find_leaks([body], {"a.py": "if width < 0:\n    raise ValueError('x')\n"}) == []


def _commit(repo: Path, message: str, files: dict[str, str | bytes], remove=()):
    for path in remove:
        (repo / path).unlink()
    for path, content in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes(content if isinstance(content, bytes) else content.encode())
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


@pytest.fixture(scope="module")
def leaky(tmp_path_factory):
    """A repository with every kind of leftover copy, binary assets and a moved function."""
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
    # The first commit keeps volume in geom/old.py: the history holds a copy under another name.
    _commit(repo, "start", {"geom/__init__.py": "", "geom/old.py": "from geom.shapes import area\n\n\n" + VOLUME,
                            "geom/shapes.py": AREA + "\n\n" + PERIMETER + "\n\nfrom geom.old import volume\n",
                            "tests/test_shapes.py": tests})
    rendered = "".join(f'<span class="n">{html.escape(line)}</span>\n' for line in AREA.splitlines())
    _commit(repo, "move volume; assets", {
        "geom/shapes.py": AREA + "\n\n" + PERIMETER + "\n\n" + VOLUME,
        "tests/test_assets.py": assets, "tests/data/logo.png": PNG,
        "build/lib/geom/shapes.py": AREA, "docs/_build/html/_modules/geom/shapes.html": rendered,
        "htmlcov/geom_shapes_py.html": f"<pre>{html.escape(AREA)}</pre>",
        "geom/shapes.py.orig": AREA, "geom/__pycache__/shapes.cpython-311.pyc": b"\x00\xff" + AREA.encode(),
        # a vendored duplicate of perimeter that is not generated: the task must be refused
        "geom/vendor/copy.py": PERIMETER.replace("def perimeter", "def _perimeter")},
        remove=["geom/old.py"])
    out = root / "out"
    features = [[Target.parse("geom/shapes.py::area")], [Target.parse("geom/shapes.py::perimeter")],
                [Target.parse("geom/shapes.py::volume")]]
    made, skipped = make_deletion_tasks(repo, out, features=features)
    return out, made, skipped


def test_generated_copies_dropped_and_other_copies_refused(leaky):
    out, made, skipped = leaky
    assert [m.task_id for m in made] == ["geom-area"]
    assert len(skipped) == 2
    assert skipped[0].startswith("geom/shapes.py::perimeter: refused: geom/vendor/copy.py:3 holds")
    assert skipped[1].startswith("geom/shapes.py::volume: refused: commit ")
    assert "geom/old.py:6 holds a copy of the deleted body of geom/shapes.py::volume" in skipped[1]


def test_task_and_history_hold_no_copy_and_keep_binaries(leaky, tmp_path):
    out, made, _ = leaky
    task = load_deletion_task(out / "geom-area")
    body = Body("area", AREA_BODY)
    assert find_leaks([body], task.files) == []
    assert not any(generated(p) for p in task.files)
    assert task.files["tests/data/logo.png"] == PNG  # carried byte for byte
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", task.metadata["git_source"], str(clone)], check=True)
    for sha in git(clone, "rev-list", "HEAD").split():
        paths = git(clone, "ls-tree", "-r", "--name-only", sha).split()
        assert not any(generated(p) for p in paths)
        text = {p: git(clone, "show", f"{sha}:{p}") for p in paths if not p.endswith(".png")}
        assert find_leaks([body], text) == [] and all("ndigits)" not in t for t in text.values())


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
