"""Every tool's success and error paths, over a session on the embedded textkit repository."""

from __future__ import annotations

import numpy as np
import pytest

from rollouts.sandbox import Limits
from rollouts.sandbox.lint import ruff_binary
from rollouts.sandbox.session import Session
from rollouts.tasks import load_repo_task
from rollouts.tasks.embedded import build_embedded_repo
from rollouts.tools import TOOLS, MemoryStore, NgramEmbedding, Toolbox, truncate
from rollouts.tools.embedding import chunks, rank


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_embedded_repo(tmp_path_factory.mktemp("textkit") / "textkit")


@pytest.fixture
def ctx(repo, tmp_path):
    from rollouts.tools import ToolContext

    task = load_repo_task(repo, ["python", "-m", "pytest", "tests"], task_id="textkit")
    assert not any(k.startswith(".git/") for k in task.files)
    limits = Limits(wall_s=10, cpu_s=10, output_bytes=1 << 16)
    with Session(task.files, limits=limits, tools={"ruff": ruff_binary()}, git_source=str(repo)) as s:
        yield ToolContext(s, task, memory=MemoryStore(tmp_path / "memory"), timeout_s=10)


BOX = Toolbox(TOOLS)


def call(ctx, name, **args):
    return BOX.call(ctx, name, args, max_chars=4000)


def test_schemas_are_declared_once_and_complete():
    schemas = BOX.schemas()
    names = [s["function"]["name"] for s in schemas]
    assert names == ["shell", "read_file", "write_file", "edit", "replace_line", "run_tests",
                     "lint", "search", "history", "memory", "think", "finish"]
    edit = schemas[names.index("edit")]["function"]["parameters"]
    assert edit["required"] == ["path", "search", "replace"]
    assert TOOLS[1].signature().startswith("read_file(path: string, start_line?: integer")


def test_argument_checking_and_unknown_tools(ctx):
    out = call(ctx, "nope")
    assert not out.ok and out.bad_call and "unknown tool 'nope'" in out.text
    assert "missing required argument 'path'" in call(ctx, "read_file").text
    assert "unknown argument(s) colour" in call(ctx, "think", thought="x", colour=1).text
    assert "'start_line' must be a integer" in call(ctx, "read_file", path="a", start_line="1").text
    assert "must be one of read, write" in call(ctx, "memory", action="erase").text
    assert not BOX.call(ctx, "think", ["x"], 100).ok


def test_shell(ctx):
    out = call(ctx, "shell", command="ls textkit && exit 3")
    assert out.ok and "strings.py" in out.text and out.text.endswith("[exit code 3]")
    ctx.timeout_s = 0.5
    assert "[timed out after" in call(ctx, "shell", command="sleep 20").text


def test_shell_output_is_truncated_with_a_note(ctx):
    out = call(ctx, "shell", command="seq 1 5000")
    assert "characters truncated ...]" in out.text and out.text.startswith("1\n2\n")
    assert "5000\n[exit code 0]" in out.text
    assert truncate("abcdef", 6) == "abcdef"


def test_read_file_ranges_and_errors(ctx):
    out = call(ctx, "read_file", path="textkit/stats.py", start_line=4, end_line=5)
    assert out.ok and "(lines 4-5 of" in out.text and "    4  def mean(xs):" in out.text
    assert "6  " not in out.text
    assert "does not exist" in call(ctx, "read_file", path="nope.py").text
    assert "without '..'" in call(ctx, "read_file", path="../../etc/passwd").text
    ctx.session.exec("ln -s /etc/hostname link")
    assert "resolves outside" in call(ctx, "read_file", path="link").text
    assert "bad line range" in call(ctx, "read_file", path="textkit/stats.py", start_line=5, end_line=2).text
    assert "has only" in call(ctx, "read_file", path="textkit/stats.py", start_line=999).text
    ctx.session.write_text("data/blob.bin", bytes(range(256)))  # never shown as text
    out = call(ctx, "read_file", path="data/blob.bin")
    assert "'data/blob.bin' is a binary file, 256 bytes" in out.text and "\\x" not in out.text


def test_write_file_and_edit(ctx):
    assert call(ctx, "write_file", path="new/mod.py", content="x = 1\ny = 1\n").text == "wrote new/mod.py (2 lines)"
    assert ctx.session.read_text("new/mod.py") == "x = 1\ny = 1\n"
    out = call(ctx, "edit", path="new/mod.py", search="y = 1", replace="y = 2")
    assert out.ok and out.text == "edited new/mod.py at line 2"
    assert ctx.session.read_text("new/mod.py") == "x = 1\ny = 2\n"
    assert "was not found" in call(ctx, "edit", path="new/mod.py", search="z = 3", replace="").text
    call(ctx, "write_file", path="new/mod.py", content="a\na\n")
    ambiguous = call(ctx, "edit", path="new/mod.py", search="a", replace="b")
    assert not ambiguous.ok and "occurs 2 times" in ambiguous.text
    assert ctx.session.read_text("new/mod.py") == "a\na\n"  # unchanged
    assert "must not be empty" in call(ctx, "edit", path="new/mod.py", search="", replace="b").text
    assert "relative to the repository root" in call(ctx, "write_file", path="/tmp/x", content="").text


def test_replace_line(ctx):
    call(ctx, "write_file", path="new/lines.py", content="a = 1\nb = 2\nc = 3")
    out = call(ctx, "replace_line", path="new/lines.py", line=2, text="b = 5")
    assert out.ok and out.text == "replaced line 2 of new/lines.py"
    assert ctx.session.read_text("new/lines.py") == "a = 1\nb = 5\nc = 3"
    # several lines in one call; the last line keeps its missing newline
    call(ctx, "replace_line", path="new/lines.py", line=3, text="if c:\n    c = 4")
    assert ctx.session.read_text("new/lines.py") == "a = 1\nb = 5\nif c:\n    c = 4"
    for line in (0, 5):
        bad = call(ctx, "replace_line", path="new/lines.py", line=line, text="x")
        assert not bad.ok and "has 4 lines; 'line' must be 1..4" in bad.text
    assert "'line' must be a integer" in call(ctx, "replace_line", path="new/lines.py", line="2",
                                              text="x").text
    assert "does not exist" in call(ctx, "replace_line", path="nope.py", line=1, text="x").text
    assert ctx.session.read_text("new/lines.py") == "a = 1\nb = 5\nif c:\n    c = 4"


def test_run_tests_summary(ctx):
    out = call(ctx, "run_tests")
    assert out.ok and out.text.startswith("tests: 13 passed, 0 failed (exit code 0)")
    call(ctx, "edit", path="textkit/stats.py", search="return sum(xs) / len(xs)", replace="return 0")
    out = call(ctx, "run_tests")
    assert out.text.startswith("tests: 11 passed, 2 failed (exit code 1)")
    assert "FAILED tests/test_stats.py::test_mean" in out.text
    # the tracebacks follow without pytest's banners, separators and progress line
    assert "--- test_mean" in out.text and "assert 0 == " in out.text
    assert "=====" not in out.text and "[100%]" not in out.text
    one = call(ctx, "run_tests", test="tests/test_roman.py")
    assert one.text.startswith("tests: 3 passed, 0 failed")
    assert "not an option" in call(ctx, "run_tests", test="--co").text
    call(ctx, "write_file", path="tests/test_broken.py", content="def test_x(:\n")
    broken = call(ctx, "run_tests", test="tests/test_broken.py")
    assert broken.text.startswith("tests: 0 passed, 1 failed") and "SyntaxError" in broken.text


def test_failure_details_keep_the_facts_and_drop_the_decoration():
    from rollouts.tools.builtin import failure_details

    output = ("F.                                                            [100%]\n"
              "=================================== FAILURES ===================================\n"
              "_________________________________ test_cap _________________________________\n"
              "\n    def test_cap():\n>       assert cap(1000) == 58\n"
              "               ^^^^^^^^^^^^^^^\n_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _\n"
              "E       assert 50 == 58\n\ntests/test_a.py:5: AssertionError\n"
              "=========================== short test summary info ============================\n"
              "FAILED tests/test_a.py::test_cap - assert 50 == 58\n")
    assert failure_details(output) == (
        "--- test_cap\n    def test_cap():\n>       assert cap(1000) == 58\n"
        "E       assert 50 == 58\ntests/test_a.py:5: AssertionError")
    # a collection error: its section, without the progress line padded to the terminal
    errors = ("E" + " " * 70 + "[100%]\n" + "=" * 30 + " ERRORS " + "=" * 30 + "\n"
              + "_" * 20 + " ERROR collecting tests/test_b.py " + "_" * 20 + "\n"
              "tests/test_b.py:1: in <module>\n    import broken\nE   ModuleNotFoundError\n"
              + "=" * 20 + " short test summary info " + "=" * 20 + "\nERROR tests/test_b.py\n")
    assert failure_details(errors) == ("--- ERROR collecting tests/test_b.py\n"
                                       "tests/test_b.py:1: in <module>\n    import broken\n"
                                       "E   ModuleNotFoundError")


def test_lint(ctx):
    assert call(ctx, "lint").text == "no issues"
    call(ctx, "write_file", path="bad.py", content="import os\nprint(undefined_name)\n")
    out = call(ctx, "lint", path="bad.py")
    assert "F401" in out.text and "F821" in out.text
    assert "without '..'" in call(ctx, "lint", path="../x").text
    assert "not an option" in call(ctx, "lint", path="--fix").text


def test_regex_search(ctx):
    out = call(ctx, "search", query=r"def (mean|median)\(")
    assert out.ok and "textkit/stats.py:4:def mean(xs):" in out.text
    assert "textkit/stats.py:11:def median(xs):" in out.text
    assert "no matches" in call(ctx, "search", query="zzz_not_there").text
    assert not call(ctx, "search", query="(unclosed").ok
    assert "not an option" in call(ctx, "search", query="x", path="--help").text


def test_semantic_search_finds_the_described_code(ctx):
    out = call(ctx, "search", query="convert integers to roman numerals", mode="semantic")
    hits = [block.split(" ")[0] for block in out.text.split("\n\n")]
    assert out.ok and "roman.py" in hits[0] and any(h.startswith("textkit/roman.py:") for h in hits)
    out = call(ctx, "search", query="running mean of a stream", mode="semantic", path="textkit")
    assert "RunningMean" in out.text.split("\n\n")[0]


def test_ngram_embedding_is_a_unit_norm_similarity():
    emb = NgramEmbedding(dim=257)
    v = emb.embed(["median of a list", "the median value of numbers", "kernel keyring"])
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-6)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2
    np.testing.assert_array_equal(emb.embed(["abc"]), emb.embed(["abc"]))
    cs = chunks("m.py", "def a():\n    return 1\n\nclass B:\n    def c(self):\n        pass\n")
    assert [(c.start, c.end) for c in cs] == [(1, 2), (4, 6), (5, 6)]
    assert rank(emb, "q", [], 3) == []


def test_history(ctx):
    log = call(ctx, "history")
    assert log.ok and log.text.splitlines()[0].endswith("slugify: split on any non-alphanumeric run, not only spaces")
    assert len(log.text.splitlines()) == 4
    path_log = call(ctx, "history", path="textkit/roman.py").text.splitlines()
    assert len(path_log) == 1 and "roman: to_roman" in path_log[0]
    sha = log.text.split()[0]
    diff = call(ctx, "history", commit=sha)
    assert "-    words = text.lower().split()" in diff.text
    assert "must be a commit hash" in call(ctx, "history", commit="--output=/x").text
    assert not call(ctx, "history", commit="deadbeef").ok


def test_history_without_git(ctx):
    import shutil

    shutil.rmtree(ctx.session.root / ".git")
    assert "no git history" in call(ctx, "history").text


def test_memory_persists_across_sessions(ctx, repo):
    assert call(ctx, "memory", action="read").text == "no notes yet for this repository"
    assert call(ctx, "memory", action="write", note="tests live in tests/").ok
    assert "must not be empty" in call(ctx, "memory", action="write").text
    from rollouts.tools import ToolContext

    with Session({"a.py": ""}) as other:  # a later episode on the same repository
        later = ToolContext(other, ctx.task, memory=MemoryStore(ctx.memory.root))
        assert call(later, "memory", action="read").text == "- tests live in tests/"
        no_store = ToolContext(other, ctx.task)
        assert "no memory store" in call(no_store, "memory", action="read").text


def test_think_and_finish(ctx):
    before = ctx.session.files()
    assert call(ctx, "think", thought="plan").text == "ok"
    assert ctx.session.files() == before
    out = call(ctx, "finish", summary="done")
    assert out.finished and out.text == "finished: done"
    assert not call(ctx, "think", thought="x").finished
