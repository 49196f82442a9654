"""The bwrap backend end to end: verdicts, fractions, lifecycle, async use. The grader tests
(`sandboxes`) run on docker as well, with the same expected verdicts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollouts.sandbox import Limits, RunRequest, Sandbox, TestCase
from rollouts.sandbox.launchers import BwrapLauncher

ADD = RunRequest(
    program="def f(x):\n    return x + 1\n",
    entry_point="f",
    cases=(
        TestCase("one", "assert candidate(1) == 2"),
        TestCase("two", "assert f(2) == 3"),
    ),
)


def _with_program(program: str) -> RunRequest:
    return RunRequest(program=program, entry_point=ADD.entry_point, cases=ADD.cases)


def test_correct_solution_passes(sandboxes):
    result = sandboxes.submit(ADD).result()
    assert (
        result.status == "passed"
        and result.tests_passed == 2
        and result.fraction_passed == 1.0
    )


def test_partial_solution_fails_with_the_failing_case_named(sandboxes):
    result = sandboxes.submit(
        _with_program("def f(x):\n    return 2 if x == 1 else 0\n")
    ).result()
    assert result.status == "failed" and result.tests_passed == 1
    assert (
        result.message
        == "two: assert f(2) == 3 -> AssertionError: got 0, compared with 3"
    )


def test_failure_message_names_the_failing_line_of_a_multi_line_case(sandboxes):
    loop = "for x in range(3):\n    y = x\n    assert candidate(x) < 2"
    result = sandboxes.submit(
        RunRequest(ADD.program, "f", (TestCase("loop", loop),))
    ).result()
    assert (
        result.message
        == "loop: assert candidate(x) < 2 -> AssertionError: got 2, compared with 2"
    )


def test_solution_exceptions_fail_and_builtin_types_reach_the_tests(sandboxes):
    req = RunRequest(
        program="def f(x):\n    raise ValueError('bad x')\n",
        entry_point="f",
        cases=(TestCase("expects", "try:\n    f(1)\n    assert False\nexcept ValueError:\n    pass"),
               TestCase("plain", "assert f(1) == 2")),
    )  # fmt: skip
    result = sandboxes.submit(req).result()
    assert result.tests_passed == 1 and "ValueError: bad x" in result.message


def test_syntax_error_and_missing_entry_point_fail(sandboxes):
    for program in ("def f(x) return x\n", "def g(x):\n    return x + 1\n"):
        result = sandboxes.submit(_with_program(program)).result()
        assert (
            result.status == "failed"
            and "loading the solution failed" in result.message
        )


def test_files_are_written_into_the_work_dir(sandboxes):
    req = RunRequest(
        program="def f(name):\n    return open(name).read()\n",
        entry_point="f",
        cases=(TestCase("read", "assert candidate('data/in.txt') == 'hello'"),),
        files={"data/in.txt": "hello"},
    )
    assert sandboxes.submit(req).result().status == "passed"


def test_work_dir_is_wiped_between_runs(sandboxes):
    write = _with_program(
        "open('/tmp/cache', 'w').write('x')\ndef f(x):\n    return x + 1\n"
    )
    read = _with_program(
        "import os\ndef f(x):\n    return x + 1 + os.path.exists('/tmp/cache')\n"
    )
    results = [sandboxes.submit(r).result() for r in (write, read, write, read)]
    assert [r.status for r in results] == ["passed", "passed", "passed", "passed"]


def test_async_submission(sandboxes):
    async def main():
        return await asyncio.gather(*(sandboxes.run(ADD) for _ in range(6)))

    assert [r.status for r in asyncio.run(main())] == ["passed"] * 6


def test_sandbox_root_is_minimal_and_read_only():
    argv = BwrapLauncher(Limits()).wrap(["true"])
    namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    if os.geteuid():  # as root no user namespace: solutions must become another uid
        namespaces = ["--unshare-all"]
    for flag in (*namespaces, "--die-with-parent", "--new-session", "--clearenv"):
        assert flag in argv
    triples = [argv[i : i + 3] for i in range(len(argv))]
    assert ["--remount-ro", "/", "--chdir"] in triples  # the root is read-only...
    assert [
        "--tmpfs",
        "/tmp",
        "--dev",
    ] in triples  # ...but for a private, size-capped /tmp
    assert argv[argv.index("--tmpfs", argv.index("/harness")) - 4] == "--size"
    assert ["--ro-bind", "/", "/"] not in triples  # only what Python needs is mounted


def _our_cgroups() -> list[Path]:
    root = Path("/sys/fs/cgroup/pids")
    return [p for p in root.rglob(f"jaxagent-sandbox-{os.getpid()}-*") if p.is_dir()]


def test_lifecycle_leaves_no_process_or_cgroup_behind(humaneval, leftovers):
    before = set(_our_cgroups())
    zygotes_before = _zygotes()
    with Sandbox("bwrap", workers=2, limits=Limits(wall_s=2, cpu_s=2)) as sb:
        bomb = humaneval["HumanEval/0"].request(
            "    import os\n    while True:\n        try: os.fork()\n        except OSError: pass\n"
        )
        assert [f.result().status for f in [sb.submit(bomb), sb.submit(bomb)]] == [
            "timeout",
            "timeout",
        ]
        assert leftovers() == []
        mine = set(_our_cgroups()) - before
        if mine:  # cgroups writable here: each idle sandbox is exactly sh->bwrap, bwrap init, zygote
            assert all(len((d / "cgroup.procs").read_text().split()) == 3 for d in mine)
    assert leftovers() == []
    assert set(_our_cgroups()) == before
    assert _zygotes() <= zygotes_before


def _zygotes() -> set[int]:
    """Zygotes started by this test process (other sessions may run their own)."""
    me = str(os.getpid())
    return {
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and "zygote.py" in _cmdline(int(p)) and me in _ancestors(int(p))
    }


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown sandbox backend 'nope'"):
        Sandbox("nope")


def test_limits_are_validated():
    with pytest.raises(ValueError, match="Limits.wall_s must be positive"):
        Limits(wall_s=0)


def test_a_sandbox_that_died_while_idle_is_replaced_without_blaming_the_next_run():
    with Sandbox("bwrap", workers=1) as sb:
        assert sb.submit(ADD).result().passed
        channel = sb._workers[0].channel
        zygote = next(p for p in _zygotes() if f"{channel.proc.pid}" in _ancestors(p))
        os.kill(int(zygote), 9)
        channel.proc.wait(timeout=10)
        assert sb.submit(ADD).result().passed


def _ancestors(pid: int) -> list[str]:
    chain = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # exited meanwhile
            return chain
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        chain.append(str(pid))
    return chain


def test_sysv_ipc_objects_do_not_survive_into_the_next_run(humaneval):
    shm = "import ctypes\nlibc = ctypes.CDLL(None)\ndef f(x):\n    return libc.shmget(0x5EED, 4096, {flags})\n"
    create = RunRequest(
        shm.format(flags="0o1666"), "f", (TestCase("made", "assert candidate(0) >= 0"),)
    )
    lookup = RunRequest(
        shm.format(flags="0o666"), "f", (TestCase("gone", "assert candidate(0) == -1"),)
    )
    with Sandbox(
        "bwrap", workers=1
    ) as sb:  # one zygote: both runs share its IPC namespace
        assert [sb.submit(r).result().status for r in (create, lookup)] == [
            "passed",
            "passed",
        ]


def test_close_cancels_queued_runs_instead_of_running_them(leftovers):
    sleepy = _with_program(
        "import time\ndef f(x):\n    time.sleep(0.5)\n    return x + 1\n"
    )
    sb = Sandbox("bwrap", workers=1)
    futures = [sb.submit(sleepy) for _ in range(20)]
    futures[0].result()
    sb.close()
    assert sum(f.cancelled() for f in futures) >= 15
    assert leftovers() == []


LEAK_PROBE = r"""import re
def f(_):
    found = set()
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if not perms.startswith("r") or hi - lo > 1 << 28:
                continue
            try:
                mem.seek(lo)
                found.update(re.findall(rb"LEAK([0-9]+)", mem.read(hi - lo)))
            except (OSError, OverflowError, ValueError):
                continue
    return sorted(x.decode() for x in found)
"""


def test_an_earlier_runs_verdict_is_not_in_a_later_solutions_memory(humaneval):
    """Failure messages quote values; the zygote must not keep them for the next fork."""
    wrong = humaneval["HumanEval/2"].request("    return 'LEAK' + str(8675309)\n")
    probe = RunRequest(
        LEAK_PROBE, "f", (TestCase("no_leak", "assert candidate(0) == []"),)
    )
    with Sandbox("bwrap", workers=1) as sb:  # one zygote serves both runs
        assert "got 'LEAK8675309'" in sb.submit(wrong).result().message
        result = sb.submit(probe).result()
    assert result.status == "passed", result.message


KEYRING = r"""import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, REQUEST_KEY = {"x86_64": (248, 249), "aarch64": (217, 218)}[platform.machine()]
def store(_):
    return libc.syscall(ADD_KEY, b"user", b"cache", b"answer", 6, -4)  # the user keyring
def find(_):
    return libc.syscall(REQUEST_KEY, b"user", b"cache", None, 0)
"""


@pytest.mark.skipif(
    os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers"
)
def test_kernel_keyrings_do_not_carry_data_into_the_next_run():
    # seccomp refuses add_key (and keyctl): nothing can be stored in the first place
    store = RunRequest(
        KEYRING, "store", (TestCase("refused", "assert candidate(0) == -1"),)
    )
    find = RunRequest(KEYRING, "find", (TestCase("gone", "assert candidate(0) == -1"),))
    with Sandbox("bwrap", workers=1) as sb:
        assert [sb.submit(r).result().status for r in (store, find)] == [
            "passed",
            "passed",
        ]


def test_posix_message_queues_cannot_be_created(sandboxes):
    mq = "import ctypes\nrt = ctypes.CDLL('librt.so.1', use_errno=True)\ndef f(_):\n    return rt.mq_open(b'/cache', 0o102, 0o600, None)\n"
    req = RunRequest(mq, "f", (TestCase("refused", "assert candidate(0) == -1"),))
    assert sandboxes.submit(req).result().status == "passed"
