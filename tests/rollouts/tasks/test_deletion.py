"""Feature-deletion tasks: the targets fail once deleted, pass on the original (in the sandbox)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from jaxagent.cli import main as cli
from rollouts.sandbox import Sandbox
from rollouts.tasks.deletion import (
    STUB,
    VENDORED_SHARE,
    Target,
    candidates,
    delete_bodies,
    deleted_bodies,
    every_body,
    load_deletion_task,
    make_deletion_tasks,
    with_vendored_copies,
)
from rollouts.tasks.embedded import build_embedded_repo, git
from rollouts.tasks.leaks import Body
from rollouts.tasks.task import TaskFormatError

SHIPPED = Path(__file__).resolve().parents[3] / "rollouts" / "tasks" / "data" / "textkit_tasks"

SOURCE = '''import os


def f(x):
    """Double x."""
    y = x * 2
    return y


class C:
    def m(self):
        """Method doc."""
        if True:
            return 1

    def bare(self):
        return os.sep
'''


def test_delete_bodies_keeps_signatures_and_docstrings():
    out = delete_bodies(SOURCE, ["f", "C.m", "C.bare"])
    assert 'def f(x):\n    """Double x."""\n    raise NotImplementedError\n' in out
    assert '    def m(self):\n        """Method doc."""\n        raise NotImplementedError\n' in out
    assert "    def bare(self):\n        raise NotImplementedError\n" in out
    assert "y = x * 2" not in out and "return 1" not in out
    compile(out, "m.py", "exec")
    with pytest.raises(ValueError, match="nope: no such function"):
        delete_bodies(SOURCE, ["nope"])
    assert delete_bodies(SOURCE, ["nope"], strict=False) == SOURCE
    assert candidates({"m.py": SOURCE, "tests/test_m.py": SOURCE, "tmpl.py": "def {{ name }}():\n"},
                      ["tests"]) == [
        Target("m.py", "f"), Target("m.py", "C.m")]  # bare has no docstring to prompt from
    # what a scan anticipates: every body outside the tests, documented or not, as deleted
    files = {"m.py": SOURCE, "tests/test_m.py": SOURCE, "tmpl.py": "def {{ name }}():\n"}
    every = [Target("m.py", "f"), Target("m.py", "C.m"), Target("m.py", "C.bare")]
    assert [(b.name, b.source) for b in every_body(files, ["tests"])] == [
        (b.name, b.source) for b in deleted_bodies(files, every)]
    with pytest.raises(ValueError, match="must look like"):
        Target.parse("m.py:f")


def test_vendored_copies_inside_functions_join_the_feature_and_others_are_left():
    body = ("    total = 0\n    for side in (width, height, width, height):\n"
            "        total = total + abs(side)\n    return total\n")
    files = {
        "geom/shapes.py": f'def perimeter(width, height):\n    """Perimeter."""\n{body}',
        "geom/vendor/copy.py": "import os\n\n\nclass Old:\n    def edge(self, width, height):\n"
                               + body.replace("    ", "        "),
        "conftest.py": f"def fixture_perimeter(width, height):\n{body}",  # the grader's to keep
        "tests/helpers.py": f"def reference(width, height):\n{body}",
        "scripts/demo.py": "width, height = 2, 3\n" + body.replace("    ", "", 1).replace("\n    ", "\n"),
    }
    feature, leaks = with_vendored_copies(files, [Target.parse("geom/shapes.py::perimeter")],
                                          ["tests"])
    assert feature == (Target("geom/shapes.py", "perimeter"), Target("geom/vendor/copy.py", "Old.edge"))
    # (each copies both deleted bodies: the vendored one is the same code)
    assert sorted({(leak.path, leak.line) for leak in leaks}) == [
        ("conftest.py", 2), ("scripts/demo.py", 2), ("tests/helpers.py", 2)]
    # a function that shares several lines (less than half the body) is no duplicate: it
    # stays, and refuses
    check = ('    if width < 0 or height < 0:\n'
             '        raise ValueError(f"negative side: width={width!r} height={height!r} in cm")\n'
             '    if not isinstance(width, (int, float)) or not isinstance(height, (int, float)):\n'
             '        raise TypeError(f"sides are numbers, not {type(width).__name__}")\n')
    rest = ("    scale = {'mm': 0.1, 'cm': 1.0, 'dm': 10.0, 'm': 100.0, 'km': 1e5}[unit]\n"
            "    rounded = round(total * scale / precision) * precision\n"
            "    log.debug('perimeter of %s by %s in %s: %s', width, height, unit, rounded)\n"
            "    return rounded\n")
    long_body = check + body.replace("    return total\n", rest)
    files = {"geom/shapes.py": ('def perimeter(width, height, unit, precision):\n'
                                f'    """Perimeter."""\n{long_body}'),
             "geom/checks.py": f"def check(width, height):\n{check}    return True\n"}
    assert 0.3 < Body("p", long_body).share(check) < VENDORED_SHARE
    feature, leaks = with_vendored_copies(files, [Target.parse("geom/shapes.py::perimeter")],
                                          ["tests"])
    assert feature == (Target("geom/shapes.py", "perimeter"),)
    assert [(leak.path, leak.line) for leak in leaks] == [("geom/checks.py", 2)]
    # one sharing an idiom (a loop header and the line after it) is no copy: the feature stays
    files["geom/checks.py"] = ("def widths(items):\n"
                               "    for side in (width, height, width, height):\n"
                               "        total = total + abs(side)\n"
                               "    return [item.width for item in items]\n")
    assert with_vendored_copies(files, [Target.parse("geom/shapes.py::perimeter")], ["tests"]) == (
        (Target("geom/shapes.py", "perimeter"),), [])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("deletion")
    repo = build_embedded_repo(root / "textkit")
    features = [[Target.parse("textkit/stats.py::variance")],
                [Target.parse("textkit/roman.py::to_roman"), Target.parse("textkit/roman.py::from_roman")],
                [Target.parse("textkit/strings.py::is_palindrome")]]
    tasks, skipped = make_deletion_tasks(repo, root / "out", features=features)
    return root, tasks, skipped


def test_generator_keeps_the_tests_that_fail(made):
    root, tasks, skipped = made
    assert skipped == []
    assert {t.task_id: t.targets for t in tasks} == {
        "textkit-variance": ("tests/test_stats.py::test_variance",),
        "textkit-to_roman+from_roman": ("tests/test_roman.py::test_from_roman",
                                        "tests/test_roman.py::test_round_trip",
                                        "tests/test_roman.py::test_to_roman"),
        "textkit-is_palindrome": ("tests/test_strings.py::test_is_palindrome",),
    }
    task = load_deletion_task(root / "out" / "textkit-variance")
    assert STUB in task.files["textkit/stats.py"] and "def variance(xs):" in task.files["textkit/stats.py"]
    assert "- textkit/stats.py: variance(xs)" in task.prompt
    assert "The population variance" in task.prompt and "def test_variance():" in task.prompt


def _graded(task_dirs):
    tasks = [load_deletion_task(d) for d in task_dirs]
    with Sandbox("bwrap", workers=2) as sb:
        ref = sb.map([t.request(t.metadata["reference"]) for t in tasks])
        deleted = sb.map([t.request("{}") for t in tasks])
    return tasks, ref, deleted


def test_made_tasks_pass_on_the_original_and_fail_deleted_in_the_sandbox(made):
    root, tasks, _ = made
    graded, ref, deleted = _graded([root / "out" / t.task_id for t in tasks])
    for task, r, d in zip(graded, ref, deleted, strict=True):
        assert r.status == "passed", (task.id, r.message)
        assert d.status == "failed" and d.tests_total == r.tests_total == 13
        assert d.tests_passed == 13 - len(task.metadata["target_tests"]), task.id


def test_shipped_tasks_hold_the_property():
    dirs = sorted(p for p in SHIPPED.iterdir() if (p / "task.json").exists())
    assert len(dirs) >= 5
    graded, ref, deleted = _graded(dirs)
    for task, r, d in zip(graded, ref, deleted, strict=True):
        assert r.status == "passed" and d.status == "failed", task.id
        assert d.tests_passed == r.tests_total - len(task.metadata["target_tests"])


def test_history_shows_commits_but_never_the_deleted_code(made, tmp_path):
    root, _, _ = made
    task = load_deletion_task(root / "out" / "textkit-to_roman+from_roman")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", task.metadata["git_source"], str(clone)], check=True)
    shas = git(clone, "rev-list", "HEAD").split()
    assert len(shas) == 4
    assert git(clone, "log", "-1", "--format=%s", shas[1]).strip() == "roman: to_roman and from_roman"
    for sha in shas:
        files = git(clone, "ls-tree", "-r", "--name-only", sha).split()
        if "textkit/roman.py" in files:
            assert "divmod" not in git(clone, "show", f"{sha}:textkit/roman.py")
    assert git(clone, "show", "HEAD:textkit/roman.py") == task.files["textkit/roman.py"]
    reference = json.loads(task.metadata["reference"])
    assert "divmod" in reference["textkit/roman.py"]


SKIPPING = {
    "calc/__init__.py": "",
    "calc/ops.py": 'def double(x):\n    """Twice x."""\n    y = x + x\n    return y\n',
    "tests/test_ops.py": "import sys\n\nimport pytest\n\nfrom calc.ops import double\n\n\n"
    "def test_double():\n    assert double(21) == 42\n\n\n"
    "@pytest.mark.skipif(sys.platform != 'plan9', reason='plan 9 only')\n"
    "@pytest.mark.parametrize('x', ['a b', 'c - d'])\n"  # ids with spaces, " - " inside
    "def test_plan9(x):\n    assert double(1) == 3\n\n\n"
    "@pytest.mark.xfail(reason='floats')\ndef test_exact():\n    assert double(0.1) + 0.1 == 0.3\n",
    "tests/test_numpy.py": "import pytest\n\nnp = pytest.importorskip('no_such_numpy')\n\n\n"
    "def test_array():\n    assert False\n",
}


def test_a_repository_whose_tests_skip_makes_tasks_whose_skips_alone_are_accepted(tmp_path):
    """One skipped test, one expected failure and one module skipped as it is collected in
    the original run: recorded in task.json, they end so again under the reference and do not
    refuse the task; without the record the reference fails, as before."""
    repo = tmp_path / "calc"
    for path, text in SKIPPING.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "calc")
    made, skipped = make_deletion_tasks(repo, tmp_path / "out")
    assert skipped == [] and [(t.task_id, t.targets) for t in made] == [
        ("calc-double", ("tests/test_ops.py::test_double",))]
    task = load_deletion_task(tmp_path / "out" / "calc-double")
    assert task.metadata["skips"] == {"tests/test_ops.py::test_plan9[a b]": "skipped",
                                      "tests/test_ops.py::test_plan9[c - d]": "skipped",
                                      "tests/test_ops.py::test_exact": "xfailed",
                                      "tests/test_numpy.py": "skipped"}
    unrecorded = dataclasses.replace(task, metadata={**task.metadata, "skips": None})
    with Sandbox("bwrap", workers=1) as sb:
        ref, deleted, old = sb.map([task.request(task.metadata["reference"]), task.request("{}"),
                                    unrecorded.request(task.metadata["reference"])])
    assert (ref.status, ref.tests_passed, ref.tests_total) == ("passed", 1, 1), ref
    assert (deleted.status, deleted.tests_passed) == ("failed", 0), deleted
    assert old.status != "passed" and "test_array was not run" in old.message, old
    (tmp_path / "out" / "calc-double" / "task.json").write_text(json.dumps(
        {**json.loads((tmp_path / "out" / "calc-double" / "task.json").read_text()),
         "skips": ["tests/test_ops.py::test_plan9"]}))
    with pytest.raises(TaskFormatError, match="task.json: field 'skips' must map test ids to one of"):
        load_deletion_task(tmp_path / "out" / "calc-double")


def test_cli_refuses_a_repository_whose_tests_fail(tmp_path, capsys):
    repo = tmp_path / "broken"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_x.py").write_text("def test_x():\n    assert False\n")
    assert cli(["tasks", "make-deletion", str(repo), "--out", str(tmp_path / "out")]) == 2
    assert "the tests must pass before deleting anything; failing" in capsys.readouterr().err
    # a test that needs a generated artefact fails without it, and the error says so
    (repo / "tests" / "test_x.py").write_text(
        "from pathlib import Path\n\n\ndef test_x():\n    assert Path('build/out.txt').exists()\n")
    (repo / "build").mkdir()
    (repo / "build" / "out.txt").write_text("made\n")
    assert cli(["tasks", "make-deletion", str(repo), "--out", str(tmp_path / "out")]) == 2
    assert "(they run without the 1 generated artefacts a task drops, e.g. build/out.txt)" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit):
        cli(["tasks", "make-deletion", str(repo)])
