"""RunCache: a test run read again only where the same files and settings would give it."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollouts.sandbox import Limits, SandboxUnavailable, run_cache
from rollouts.sandbox.run_cache import RunCache, workdir_digest
from rollouts.sandbox.session import Session

REPO = {
    "pkg/__init__.py": "",
    "pkg/a.py": "def f():\n    return 3\n",
    "tests/test_a.py": "from pkg.a import f\n\ndef test_f():\n    assert f() == 7, 'f should be 7'\n",
}
# a suite that writes into the work dir at each run: each real run reads one more line
COUNTING = {
    "tests/test_count.py": (
        "import pathlib\n\ndef test_count():\n    p = pathlib.Path('runs.txt')\n"
        "    p.write_text(p.read_text() + 'x' if p.exists() else 'x')\n"
        "    assert len(p.read_text()) == 0, f'runs {len(p.read_text())}'\n"),
}


def _session(files, **options) -> Session:
    try:
        return Session(files, backend="bwrap", **options)
    except SandboxUnavailable as e:
        pytest.skip(f"bwrap: {e}")


def test_a_run_is_read_again_by_any_session_holding_the_same_files():
    cache = RunCache()
    with _session(REPO) as one, _session(REPO) as two:
        first, outcomes = one.run_pytest([], cache=cache)
        assert not first.cached and (cache.hits, cache.misses) == (0, 1)
        assert outcomes["tests/test_a.py::test_f"][0] == "failed"
        again, again_outcomes = two.run_pytest([], cache=cache)
        assert again.cached and cache.hits == 1
        assert (again.output, again.exit_code, again_outcomes) == (first.output, first.exit_code,
                                                                   outcomes)
        two.write_text("pkg/a.py", "def f():\n    return 7\n")  # another work dir: runs
        fixed, fixed_outcomes = two.run_pytest([], cache=cache)
        assert not fixed.cached and fixed_outcomes["tests/test_a.py::test_f"][0] == "passed"
        one.write_text("pkg/a.py", "def f():\n    return 7\n")  # now the same as two's
        assert one.run_pytest([], cache=cache)[1] == fixed_outcomes
        assert one.run_pytest([], cache=cache)[0].cached
        # other arguments or limits are another run
        assert not one.run_pytest(["tests/test_a.py"], cache=cache)[0].cached
    with _session(REPO, limits=Limits(wall_s=7.0)) as three:
        assert not three.run_pytest([], cache=cache)[0].cached
    assert (cache.hits, cache.misses) == (3, 4)


def test_a_run_that_wrote_into_the_work_dir_or_timed_out_runs_again():
    cache = RunCache()
    with _session(COUNTING) as s:
        seen = [s.run_pytest([], cache=cache) for _ in range(3)]
        assert [r.cached for r, _ in seen] == [False] * 3
        assert [o["tests/test_count.py::test_count"][1].split("runs ")[-1][:1]
                for _, o in seen] == ["1", "2", "3"]
        assert s.read_text("runs.txt") == "xxx"
    slow = {"tests/test_slow.py": "import time\n\ndef test_slow():\n    time.sleep(30)\n"}
    with _session(slow, limits=Limits(wall_s=1.0)) as s:
        assert s.run_pytest([], cache=cache)[0].timed_out
        assert not s.run_pytest([], cache=cache)[0].cached
    assert cache.hits == 0


def test_the_work_dir_digest_sees_names_bytes_modes_links_and_git(tmp_path):
    def tree(name, change=None):
        root = tmp_path / name
        (root / "a").mkdir(parents=True)
        (root / "a" / "x.py").write_text("x = 1\n")
        if change:
            change(root)
        return workdir_digest(root)

    base = tree("base")
    assert tree("same") == base  # relative paths: where the work dir lies does not count
    changes = {
        "bytes": lambda r: (r / "a" / "x.py").write_text("x = 2\n"),
        "name": lambda r: (r / "a" / "x.py").rename(r / "a" / "y.py"),
        "mode": lambda r: os.chmod(r / "a" / "x.py", 0o755),
        "link": lambda r: os.symlink("a/x.py", r / "link"),
        "git": lambda r: (r / ".git").mkdir(),
        "empty dir": lambda r: (r / "a" / "empty").mkdir(),
    }
    digests = {what: tree(what, change) for what, change in changes.items()}
    assert base not in digests.values() and len(set(digests.values())) == len(changes)


def test_a_work_dir_the_host_cannot_read_is_never_matched(tmp_path, monkeypatch):
    (tmp_path / "x.py").write_text("x = 1\n")
    assert workdir_digest(tmp_path) == workdir_digest(tmp_path)

    def unreadable(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(run_cache, "open", unreadable, raising=False)
    assert workdir_digest(tmp_path) != workdir_digest(tmp_path)


@dataclasses.dataclass(frozen=True)
class _Result:
    value: int
    cached: bool = False
    output: str = ""


@dataclasses.dataclass(frozen=True)
class _Output:
    output: str
    cached: bool = False


def test_runs_of_one_key_in_flight_together_run_once_where_the_run_is_kept():
    for keep in (True, False):
        cache, calls, gate = RunCache(), [], threading.Event()

        def run():
            calls.append(1)
            gate.wait(5)
            return _Result(len(calls)), {"t": ("passed", "")}, keep

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(cache.run, b"k", run) for _ in range(6)]
            time.sleep(0.2)  # every lookup made: five wait for the first run
            gate.set()
            got = [f.result() for f in futures]
        if keep:
            assert len(calls) == 1 and (cache.hits, cache.misses) == (5, 1)
            assert sorted(r.cached for r, _ in got) == [False] + [True] * 5
            assert {r.value for r, _ in got} == {1}
        else:  # not kept: each waiter ran for itself, and nothing is kept
            assert len(calls) == 6 and (cache.hits, cache.misses) == (0, 6)
            assert not any(r.cached for r, _ in got)
            assert not cache.run(b"k", lambda: (_Result(9), {}, False))[0].cached


def test_the_cache_keeps_its_size_and_forgets_a_run_that_raised():
    cache = RunCache(size=2)
    for k in (b"a", b"b", b"c"):
        cache.run(k, lambda: (_Result(0), {}, True))
    assert not cache.run(b"a", lambda: (_Result(1), {}, True))[0].cached  # evicted
    assert cache.run(b"c", lambda: (_Result(2), {}, True))[0] == _Result(0, cached=True)

    def broken():
        raise OSError("the sandbox went away")

    with pytest.raises(OSError):
        cache.run(b"d", broken)
    assert cache.run(b"d", lambda: (_Result(3), {}, True))[0] == _Result(3)
    with pytest.raises(ValueError, match="size"):
        RunCache(size=0)


def test_the_cache_keeps_at_most_max_bytes_of_output():
    cache = RunCache(max_bytes=10)
    for k in (b"a", b"b", b"c"):  # 4 bytes each: the third pushes the first out
        cache.run(k, lambda: (_Output("1234"), {}, True))
    assert cache.bytes == 8
    assert cache.run(b"c", lambda: (_Output("new!"), {}, True))[0].cached
    assert not cache.run(b"a", lambda: (_Output("1234"), {}, True))[0].cached
    cache.run(b"big", lambda: (_Output("x" * 11), {}, True))  # more than all: not kept at all
    assert cache.bytes == 0 and not cache.run(b"big", lambda: (_Output("x"), {}, True))[0].cached
