"""Reward capacity across training processes: P processes, each with its own sandbox of W
workers grading its share of the rows, against one process with P x W workers.

In a multi-process run every process grades the rows it generated with its own `Scorer` and
sandbox on its own host's cores (nothing is sent to a central grader), so the fleet grows with
the cluster. Here the P processes share one host, which is what a 2-core machine can show: the
same cores give the same solutions/s whether they are split across processes or not.

    python benchmarks/reward_capacity.py [--configs 1x1 1x2 2x1] [--rounds 3]

Each configuration grades the 164 canonical HumanEval solutions `--rounds` times (each process
its i::P share) after a warm-up; every process starts its clock at one barrier and the slowest
process's time counts. Prints solutions/s per configuration and the ratio to 1 x 1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _grade_share(index: int, processes: int, workers: int, rounds: int, backend: str,
                 barrier, out) -> None:
    from rollouts.sandbox import Sandbox
    from rollouts.tasks import humaneval_tasks

    tasks = humaneval_tasks()[index::processes]
    requests = [t.request(t.metadata["reference"]) for t in tasks]
    with Sandbox(backend, workers=workers) as sandbox:
        sandbox.map(requests[:workers])  # start every zygote before the clock
        barrier.wait()
        start = time.perf_counter()
        for _ in range(rounds):
            failed = [t.id for t, r in zip(tasks, sandbox.map(requests), strict=True) if not r.passed]
            if failed:
                raise SystemExit(f"canonical solutions failed: {failed}")
        out.put((len(requests) * rounds, time.perf_counter() - start))


def measure(processes: int, workers: int, rounds: int, backend: str) -> float:
    """Solutions per second of `processes` x `workers`, the slowest process's clock."""
    ctx = mp.get_context("spawn")  # a fresh interpreter per process, as a training process is
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_grade_share, args=(i, processes, workers, rounds, backend,
                                                    barrier, out)) for i in range(processes)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a grading process exited {p.exitcode}")
    return sum(n for n, _ in results) / max(s for _, s in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["1x1", "1x2", "2x1"],
                   help="PROCESSESxWORKERS each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="bwrap", choices=("bwrap", "docker", "process"))
    args = p.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}  {os.cpu_count()} cores, load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()) + f", backend {args.backend}")
    base = None
    for config in args.configs:
        processes, workers = map(int, config.split("x"))
        rate = measure(processes, workers, args.rounds, args.backend)
        base = base or rate
        print(f"{processes} process(es) x {workers} worker(s): {rate:6.1f} solutions/s "
              f"({rate / base:.2f}x {args.configs[0]})", flush=True)


if __name__ == "__main__":
    main()
