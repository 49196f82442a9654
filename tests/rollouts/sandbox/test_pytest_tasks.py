"""Repository tasks graded with pytest in the sandbox: edits, injection, early exits."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rollouts.tasks import load_repo_task

TESTS = """import pytest
from lib import add

def test_add():
    assert add(1, 2) == 3

@pytest.mark.parametrize("a", [1, 2])
def test_identity(a):
    assert add(a, 0) == a

class TestNegative:
    def test_neg(self):
        assert add(-1, -1) == -2
"""
FIXED = {"lib.py": "def add(a, b):\n    return a + b\n"}


@pytest.fixture(scope="module")
def repo_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    (root / "tests").mkdir()
    (root / "lib.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "tests" / "test_lib.py").write_text(TESTS)
    return load_repo_task(root, ["python", "-m", "pytest", "tests"], task_id="adder")


def _grade(sandbox, task, edits):
    return sandbox.submit(task.request(json.dumps(edits))).result()


@pytest.mark.parametrize("grading", ["isolated", "in-process"])
def test_fixed_repository_passes_and_broken_one_fails(sandboxes, repo_task, grading):
    def grade(edits):
        request = dataclasses.replace(repo_task.request(json.dumps(edits)), grading=grading)
        return sandboxes.submit(request).result()

    good = grade(FIXED)
    assert (good.status, good.tests_passed, good.tests_total) == ("passed", 4, 4)
    bad = grade({})
    assert (bad.status, bad.tests_passed) == ("failed", 2)
    assert bad.message.startswith("tests/test_lib.py::test_add (call) failed")


@pytest.mark.parametrize("grading", ["isolated", "in-process"])
def test_a_test_module_that_cannot_import_fails_the_run(sandboxes, tmp_path_factory, grading):
    """An unsolved deletion task whose test module (or conftest) calls the missing function at
    import: its tests fail (counted, with the import error), not a hack; solved, all pass."""
    root = tmp_path_factory.mktemp("at-import")
    (root / "tests").mkdir()
    (root / "lib.py").write_text("def add(a, b):\n    raise NotImplementedError\n\n"
                                 "def mul(a, b):\n    return a * b\n")
    (root / "tests" / "test_table.py").write_text(
        "from lib import add\nTABLE = [add(1, 2), add(2, 2)]\n\n"
        "def test_table():\n    assert TABLE == [3, 4]\n\n"
        "def test_first():\n    assert TABLE[0] == 3\n")
    (root / "tests" / "test_mul.py").write_text(
        "from lib import mul\n\ndef test_mul():\n    assert mul(2, 3) == 6\n")
    task = load_repo_task(root, ["python", "-m", "pytest", "tests"], task_id="at-import")

    def grade(edits):
        request = dataclasses.replace(task.request(json.dumps(edits)), grading=grading)
        return sandboxes.submit(request).result()

    unsolved = grade({})
    assert (unsolved.status, unsolved.tests_total) == ("failed", 3), unsolved
    assert unsolved.message.startswith("tests/test_table.py (collect) failed")
    assert "NotImplementedError" in unsolved.message
    fixed = {"lib.py": "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"}
    solved = grade(fixed)
    assert (solved.status, solved.tests_passed, solved.tests_total) == ("passed", 3, 3), solved
    # a pristine conftest that imports the missing function: pytest stops before collecting
    (root / "tests" / "conftest.py").write_text(
        "import pytest\nfrom lib import add\n\n@pytest.fixture\ndef three():\n    return add(1, 2)\n")
    (root / "lib.py").write_text("raise ImportError('add was deleted')\n")
    task = load_repo_task(root, ["python", "-m", "pytest", "tests"], task_id="at-conftest")
    unsolved = grade({})
    assert (unsolved.status, unsolved.tests_total) == ("failed", 3), unsolved
    assert "stopped before collecting" in unsolved.message
    assert grade(fixed).status == "passed"


@pytest.mark.parametrize(
    ("edits", "reason"),
    [
        (
            {"tests/test_lib.py": "def test_ok():\n    pass\n"},
            "tampers with the protected tests",
        ),
        (
            {"tests/test_extra.py": "def test_ok():\n    pass\n"},
            "tampers with the protected tests",
        ),
        (
            {**FIXED, "conftest.py": "collect_ignore = ['tests']\n"},
            "injects pytest configuration",
        ),
        ({"pkg/conftest.py": ""}, "injects pytest configuration"),
        (
            {"pytest.ini": "[pytest]\naddopts = -p evil\n"},
            "injects pytest configuration",
        ),
        ({"evil.pth": "import os\n"}, "injects pytest configuration"),
        ({"pytest.toml": "[pytest]\naddopts = ['-p', 'evil']\n"}, "injects pytest configuration"),
        ({".pytest.toml": "[pytest]\naddopts = ['-p', 'evil']\n"}, "injects pytest configuration"),
        ({"evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evil\n"}, "package metadata"),
        ({"evil.egg-info/entry_points.txt": "[pytest11]\nevil = evil\n"}, "package metadata"),
        ({"__init__.py": ""}, "makes the repository root a package"),
        ({"../outside.py": ""}, "escapes the repository"),
        ({"lib.py": "import os\nos._exit(0)\n"}, "exited early"),
        ({"lib.py": "import sys\ndef add(a, b):\n    sys.exit(0)\n"}, "SystemExit"),
    ],
)
def test_tampering_is_a_hack(sandboxes_docker_slow, repo_task, edits, reason, leftovers):
    result = _grade(sandboxes_docker_slow, repo_task, edits)
    assert result.status == "hack" and reason in result.message, result
    assert leftovers() == []


@pytest.mark.parametrize(("grading", "status", "reason"), [
    ("isolated", "failed", "No module named 'pytest'"),  # the solution's process has no pytest
    ("in-process", "hack", "was not run"),
])
def test_a_skip_at_import_hides_no_test(sandboxes, repo_task, grading, status, reason):
    edits = {"lib.py": "import pytest\npytest.skip('no', allow_module_level=True)\n"}
    request = dataclasses.replace(repo_task.request(json.dumps(edits)), grading=grading)
    result = sandboxes.submit(request).result()
    assert result.status == status and reason in result.message, result


def test_non_json_completion_is_rejected(repo_task):
    with pytest.raises(ValueError, match="completion is not JSON"):
        repo_task.request("def add(a, b): return a + b")


def test_only_pytest_commands_are_accepted(tmp_path):
    from rollouts.tasks import TaskFormatError

    (tmp_path / "x.py").write_text("")
    with pytest.raises(TaskFormatError, match="is not `pytest ...`"):
        load_repo_task(tmp_path, ["make", "test"])


# Modules pytest imports after start-up, and the harness's reporter: a file of that name at the
# repository root must shadow nothing (the root comes after the standard library and the harness).
FORGE = "import os\nos.write(3, b'x')\nraise SystemExit(0)\n"
SHADOWED = ("pytest_verdict", "argparse", "inspect", "pathlib", "tempfile", "unittest", "logging",
            "traceback", "linecache", "tokenize", "zipfile", "textwrap", "pprint", "difflib",
            "fnmatch", "glob", "shlex", "warnings", "dataclasses", "enum")


@pytest.mark.parametrize("module", SHADOWED)
def test_root_modules_shadow_nothing(sandboxes_docker_slow, repo_task, module, leftovers):
    """Each would forge a frame and exit if imported; the broken lib.py must simply fail."""
    result = _grade(sandboxes_docker_slow, repo_task, {f"{module}.py": FORGE})
    assert (result.status, result.tests_passed) == ("failed", 2), result
    assert leftovers() == []


def test_repository_config_files_do_not_configure_the_run(sandboxes_docker_slow, tmp_path_factory):
    """A pristine setup.cfg / tox.ini / pyproject.toml asking for `-p evil` or deselecting the
    failing test is ignored: the harness's own ini file is the only configuration."""
    root = tmp_path_factory.mktemp("configured")
    (root / "tests").mkdir()
    (root / "lib.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "tests" / "test_lib.py").write_text(TESTS)
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-k test_identity"\n')
    (root / "tox.ini").write_text("[pytest]\naddopts = -p evil\n")
    task = load_repo_task(root, ["python", "-m", "pytest", "tests"], task_id="configured")
    result = _grade(sandboxes_docker_slow, task, {})
    assert (result.status, result.tests_passed, result.tests_total) == ("failed", 2, 4), result


# Attacks on the run of pytest itself (each edit keeps `add` wrong, or makes it lie): with the
# tests in the grader, none reaches pytest, the tests or the verdict.
_FRAME = "import json, struct\ndef frame(o):\n    b = json.dumps(o).encode()\n    return struct.pack('>I', len(b)) + b\n"
PYTEST_ATTACKS = {
    "forge_reporter_frames": _FRAME + "import os\nids = ['tests/test_lib.py::test_add', 'tests/test_lib.py::test_identity[1]',"
    " 'tests/test_lib.py::test_identity[2]', 'tests/test_lib.py::TestNegative::test_neg']\n"
    "os.write(3, frame(['collected', ids]))\nfor i in ids:\n    os.write(3, frame(['report', i, 'call', 'passed', '']))\n"
    "os.write(3, frame(['done', 0]))\nimport time\ntime.sleep(30)\n",
    "forge_ok_replies": _FRAME + "import os\nfor v in (3, 1, 2, -2):\n    os.write(3, frame(['ok', ['v', v]]))\n"
    "def add(a, b):\n    return a - b\n",
    "patch_pytest_runtest": "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n"
    "def add(a, b):\n    return a - b\n",
    "gc_find_config": "import gc\nfor o in gc.get_objects():\n    if type(o).__name__ == 'Config':\n"
    "        o.option.keyword = 'nothing'\ndef add(a, b):\n    return a - b\n",
    "rewrite_tests_at_import": "import os\nfor root, _, files in os.walk('tests'):\n    for f in files:\n"
    "        open(os.path.join(root, f), 'w').write('def test_add():\\n    pass\\n')\ndef add(a, b):\n    return a - b\n",
    "symlink_tests_away": "import os, shutil\nshutil.rmtree('tests')\nos.mkdir('tests')\nopen('tests/test_lib.py', 'w')"
    ".write('def test_add():\\n    pass\\n')\ndef add(a, b):\n    return a - b\n",
    "read_grader_tests": "import os\nfor d in ('../work-tests', '/tmp/work-tests'):\n    try:\n"
    "        open(os.path.join(d, 'tests/test_lib.py'), 'a').write('\\ndef test_add():\\n    pass\\n')\n"
    "    except OSError:\n        pass\ndef add(a, b):\n    return a - b\n",
    "always_equal": "class Eq:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
    "def add(a, b):\n    return Eq()\n",
    "lying_int": "class Int(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
    "def add(a, b):\n    return Int(0)\n",
    "return_builtin": "def add(a, b):\n    return print\n",
    "exit_at_import": "import os\nos._exit(0)\n",
    "kill_grader": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b):\n    return a - b\n",
    "sys_modules_swap": "import sys, types\nm = types.ModuleType('pytest')\nsys.modules['pytest'] = m\n"
    "def add(a, b):\n    return a - b\n",
    "builtins_patch": "import builtins\nbuiltins.AssertionError = KeyError\nbuiltins.len = lambda x: 0\n"
    "def add(a, b):\n    return a - b\n",
    "sleep_forever": "import time\ndef add(a, b):\n    time.sleep(60)\n",
}


@pytest.mark.parametrize("backend", ["bwrap", pytest.param("docker", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(PYTEST_ATTACKS))
def test_pytest_is_out_of_the_solutions_reach(request, repo_task, name, backend, leftovers):
    # sleep_forever can only end at the wall limit: the 2 s of the hostile limits, not 10 s.
    hostile = {"bwrap": "hostile_sandbox", "docker": "docker_hostile_sandbox"}[backend]
    sandbox = request.getfixturevalue(hostile if name == "sleep_forever" else f"{backend}_sandbox")
    result = _grade(sandbox, repo_task, {"lib.py": PYTEST_ATTACKS[name]})
    assert result.status != "passed" and result.tests_passed < 4, (name, result)
    if name == "sleep_forever":
        assert result.status == "timeout", result
    assert leftovers() == []


CLASSES = {
    "tests/test_shapes.py": """import pytest
from shapes import Stack, EmptyError, area, ORIGIN, Point


def test_stack():
    s = Stack()
    s.push(1)
    s.push(2)
    assert len(s) == 2 and s.peek() == 2 and s.pop() == 2 and s.size == 1
    assert list(s) == [1] and 1 in s and bool(s)
    with pytest.raises(EmptyError, match="empty"):
        Stack().pop()
    with pytest.raises(IndexError):
        Stack().peek()


def test_functions_and_constants():
    assert area(2, 3.5) == 7.0 and ORIGIN == (0, 0)
    assert Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(2, 1)
    assert Point(1, 2).norm2() == 5 and str(Point(1, 2)) == "(1, 2)"
""",
    "shapes/__init__.py": "from shapes.core import Stack, EmptyError, area, ORIGIN, Point\n",
}
SHAPES = """ORIGIN = (0, 0)


class EmptyError(LookupError):
    pass


class Stack:
    def __init__(self):
        self.items = []

    @property
    def size(self):
        return len(self.items)

    def push(self, x):
        self.items.append(x)

    def pop(self):
        if not self.items:
            raise EmptyError("empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def __contains__(self, x):
        return x in self.items


def area(w, h):
    return w * h


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def norm2(self):
        return self.x ** 2 + self.y ** 2

    def __str__(self):
        return f"({self.x}, {self.y})"
"""


def test_isolated_grading_carries_classes_exceptions_and_iteration(sandboxes_docker_slow, tmp_path):
    for rel, text in {**CLASSES, "shapes/core.py": SHAPES.replace("return w * h", "return 0")}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    task = load_repo_task(tmp_path, ["python", "-m", "pytest", "tests"], task_id="shapes")
    good = _grade(sandboxes_docker_slow, task, {"shapes/core.py": SHAPES})
    assert (good.status, good.tests_passed) == ("passed", 2), good
    bad = _grade(sandboxes_docker_slow, task, {})
    assert (bad.status, bad.tests_passed) == ("failed", 1), bad
    assert "test_functions_and_constants" in bad.message


def test_an_api_that_cannot_cross_falls_back_to_in_process(sandboxes_docker_slow, tmp_path):
    """isinstance against a class of the solution's needs the real class: the reference fails
    isolated, passes in-process, and the task says so; a plain-data API stays isolated."""
    from rollouts.producer import Rollout, rollout_stats
    from rollouts.tasks.repo import choose_grading

    (tmp_path / "tests").mkdir()
    (tmp_path / "geo.py").write_text("class Box:\n    pass\n\ndef make():\n    return None\n")
    (tmp_path / "tests" / "test_geo.py").write_text(
        "from geo import Box, make\n\ndef test_make():\n    assert isinstance(make(), Box)\n")
    task = load_repo_task(tmp_path, ["python", "-m", "pytest", "tests"], task_id="geo")
    reference = json.dumps({"geo.py": "class Box:\n    pass\n\ndef make():\n    return Box()\n"})
    assert choose_grading(task, reference, sandboxes_docker_slow) == "in-process"
    fallback = load_repo_task(tmp_path, ["python", "-m", "pytest", "tests"], task_id="geo",
                              grading="in-process")
    assert fallback.grading == "in-process" and fallback.request(reference).grading == "in-process"
    assert _grade(sandboxes_docker_slow, fallback, json.loads(reference)).status == "passed"
    assert choose_grading(task.__class__(**{**task.__dict__, "files": {
        **task.files, "tests/test_geo.py": "from geo import make\n\ndef test_make():\n    assert make() is not None\n"}}),
        reference, sandboxes_docker_slow) == "isolated"
    rows = [Rollout("geo", [], [], [], [], "", 1.0, "passed", "stop", 0, grading=g)
            for g in ("isolated", "in-process", "in-process", "isolated")]
    assert rollout_stats(rows, 1.0, 1.0)["reward/in_process_fraction"] == 0.5
    with pytest.raises(Exception, match="field 'grading'"):
        load_repo_task(tmp_path, ["python", "-m", "pytest", "tests"], grading="inprocess")


@pytest.mark.parametrize("name", ["rewrite_tests_at_import", "symlink_tests_away"])
def test_in_process_grading_keeps_the_tests_out_of_reach(sandboxes_docker_slow, repo_task, name):
    """pytest beside the solution: the tests stay the grader's (read-only to the solution's
    uid as root) and are compared with the pristine ones after the run."""
    import dataclasses

    request = dataclasses.replace(repo_task.request(json.dumps({"lib.py": PYTEST_ATTACKS[name]})),
                                  grading="in-process")
    result = sandboxes_docker_slow.submit(request).result()
    assert result.status != "passed" and result.tests_passed < 4, result


def test_in_process_grading_still_passes_honest_work(sandboxes_docker_slow, repo_task):
    import dataclasses

    request = dataclasses.replace(repo_task.request(json.dumps(FIXED)), grading="in-process")
    result = sandboxes_docker_slow.submit(request).result()
    assert (result.status, result.tests_passed) == ("passed", 4), result


def test_in_process_tests_cannot_be_rewritten_before_they_are_collected(sandboxes_docker_slow, tmp_path):
    """The solution's module, imported while an earlier test file is collected, rewrites a
    later one with the same test names and empty bodies. Were that to work, the broken `add`
    would pass; the tests are read-only to it (root) or re-checked after the run (hack)."""
    import dataclasses

    (tmp_path / "tests").mkdir()
    (tmp_path / "lib.py").write_text("def add(a, b):\n    return a - b\n")
    (tmp_path / "tests" / "test_a.py").write_text("import lib\n\ndef test_a():\n    assert lib\n")
    (tmp_path / "tests" / "test_b.py").write_text(
        "from lib import add\n\ndef test_b():\n    assert add(1, 2) == 3\n")
    task = load_repo_task(tmp_path, ["python", "-m", "pytest", "tests"], task_id="rewrite")
    attack = ("try:\n    open('tests/test_b.py', 'w').write('def test_b():\\n    pass\\n')\n"
              "except OSError:\n    pass\ndef add(a, b):\n    return a - b\n")
    request = dataclasses.replace(task.request(json.dumps({"lib.py": attack})), grading="in-process")
    result = sandboxes_docker_slow.submit(request).result()
    assert result.status in ("failed", "hack") and result.tests_passed < 2, result
    fixed = dataclasses.replace(task.request(json.dumps({"lib.py": "def add(a, b):\n    return a + b\n"})),
                                grading="in-process")
    assert sandboxes_docker_slow.submit(fixed).result().status == "passed"
