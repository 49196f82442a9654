"""Episodes in flight (`agent.episodes`, the sampler's slots) against wall clock, on real
episodes: the same held-out agent evaluation of one checkpoint (`jaxagent eval`, the config's
tools, sandbox and budgets) with each slot count in turn, one process each, side by side in
one table with the time ratio to the first count and the peak RSS.

With fewer slots than episodes a finished episode's slot is refilled at once, but the rows
share the KV cache's write index, so a refilled row starts behind the padding the others left
and the cache is rebuilt (every live history prefilled again) when it reaches its bound; with a
slot per episode every row starts at slot 0 and the cache stays as short as the longest
episode. Each decode step's attention reads rows x cache slots either way.

    PYTHONPATH=. python benchmarks/agent_slots.py --config configs/agent_default.yaml \
        --checkpoint runs/agent_default --slots 16 32 64 --samples 4
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time


def evaluate(config: str, checkpoint: str, slots: int, samples: int, overrides: list[str]):
    """(seconds, peak RSS in GB, printed scores) of one `jaxagent eval` with `slots`."""
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, "-m", "jaxagent.cli", "eval", "--config", config, "--checkpoint",
               checkpoint, "--samples", str(samples), "--k", "1", f"agent.episodes={slots}",
               f"workdir={workdir}", *overrides]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS (KiB on Linux)
        seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out}")
    scores = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return seconds, usage.ru_maxrss / 2**20, {k: float(v) for k, v in scores.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/agent_default.yaml")
    ap.add_argument("--checkpoint", required=True, help="a run's workdir (its newest checkpoint)")
    ap.add_argument("--slots", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--samples", type=int, default=4, help="episodes per held-out task")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = ap.parse_args()
    print(f"# {platform.node()} ({os.cpu_count()} cores), {args.config}, {args.checkpoint}, "
          f"{args.samples} episodes a held-out task, {time.strftime('%Y-%m-%d')}")
    print("| slots | wall s | ratio to first | peak RSS GB | pass@1 | bad calls an episode | turns |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    first = None
    for slots in args.slots:
        seconds, rss, s = evaluate(args.config, args.checkpoint, slots, args.samples,
                                   args.overrides)
        first = first or seconds
        print(f"| {slots} | {seconds:.0f} | {seconds / first:.2f} | {rss:.2f} | "
              f"{s['eval/pass@1']:.3f} | "
              f"{s['eval/agent/bad_tool_calls'] / s['eval/agent/episodes']:.2f} | "
              f"{s['eval/agent/turns_mean']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
