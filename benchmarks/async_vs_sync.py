"""Async vs synchronous rollouts: the same RL steps with rollout.max_staleness=0 (sample, score,
train, repeat) and with rollout.max_staleness=1 (batch s+1 sampled and scored while step s
trains), side by side in one process.

Scenarios:
  default     the embedded default run (tiny byte-level model, synthetic tasks, SFT warm-up,
              bwrap sandbox), `--steps` RL steps of 16 prompts x 8 completions.
  slow-tests  the same, but every task's test suite sleeps 0.5-2 s inside the sandbox (a fixed
              duration per task, from a hash of its id) before its asserts, as real repository
              test suites take seconds; 4 prompts x 8 completions, 16 sandbox workers.
  gpu         a ~270M-parameter decoder (24 layers, d_model 1024, bf16 compute) on one GPU that
              sampler and trainer share; 16 prompts x 8 completions, 128 new tokens, the slow
              test suites, the `process` sandbox backend (no bwrap there) and a plain task
              iterator (no grain). Random init, no SFT: the point is the schedule, not learning.

Timing: the train step's shapes follow the batch's longest prompt + completion, and each
`train()` call builds its own optimizer (a new jit cache key), so compiled programs are shared
through JAX's persistent compilation cache: an untimed synchronous run of the same `--steps`
first fills it with every program the timed runs need (the async run may still meet a shape of
its own: any compile counts against async). Then each mode
runs `--steps` steps from the same initial weights; a mode's wall clock is the sum of its
`time/step_s` (the RL loop from the first batch request to the last update; SFT, evaluation and
checkpoints are off the clock). The table shows per-step means of the split.

    python benchmarks/async_vs_sync.py                         # default, 20 steps
    python benchmarks/async_vs_sync.py --scenario slow-tests --steps 12
    python benchmarks/async_vs_sync.py --scenario gpu          # on a GPU machine

The last line is `speedup: X.XX` (synchronous wall clock / asynchronous wall clock).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPLIT = ("generate_s", "reward_s", "train_s", "weight_sync_s", "wait_s")


class TaskCycle:
    """Shuffled tasks, repeated forever; checkpointable like the grain iterator."""

    def __init__(self, tasks, seed: int):
        self.tasks = list(tasks)
        self.order = np.random.default_rng(seed).permutation(len(self.tasks))
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        task = self.tasks[self.order[self.i % len(self.tasks)]]
        self.i += 1
        return task

    def get_state(self) -> dict:
        return {"i": self.i}

    def set_state(self, state: dict) -> None:
        self.i = state["i"]


def slow_suite(task):
    """`task` whose test suite first sleeps 0.5-2 s (fixed per task) in the sandbox."""
    seconds = 0.5 + 1.5 * (zlib.crc32(task.id.encode()) % 1000) / 999
    setup = f"{task.test_setup}\nimport time\ntime.sleep({seconds:.3f})\n"
    return dataclasses.replace(task, test_setup=setup)


SCENARIOS = {
    "default": [],
    "slow-tests": ["train.prompts_per_step=4", "rewards.workers=16"],
    "gpu": ["model.hidden_size=1024", "model.intermediate_size=2816", "model.num_layers=24",
            "model.num_heads=16", "model.num_kv_heads=4", "model.head_dim=64",
            "model.dtype=bfloat16", "sft.steps=0", "train.max_new_tokens=128",
            "sampler.prompt_bucket=128", "rewards.backend=process", "rewards.workers=16",
            "optim.learning_rate=1e-5"],
}


def run(overrides: list[str], steps: int, staleness: int, workdir: Path, slow: bool) -> dict:
    from jaxagent.config import load_config
    from jaxagent.metrics import read_metrics
    from jaxagent.train.build import load_task_splits
    from jaxagent.train.loop import train

    cfg = load_config(None, [*overrides, f"train.steps={steps}", "tasks.num_eval=0",
                             "checkpoint.every=0", "eval.every=0",
                             f"rollout.max_staleness={staleness}", f"workdir={workdir}"])
    tasks = None
    if slow:
        tasks = TaskCycle([slow_suite(t) for t in load_task_splits(cfg)[0]], cfg.seed)
    t0 = time.perf_counter()
    train(cfg, task_iter=tasks)
    total = time.perf_counter() - t0
    rows = [r for r in read_metrics(workdir / "metrics.jsonl") if "train/loss" in r]
    out = {"wall_s": sum(r["time/step_s"] for r in rows), "process_s": total,
           "staleness": float(np.mean([r["rollout/staleness"] for r in rows])),
           "overlap": float(np.mean([r["rollout/overlap"] for r in rows])),
           "reward": float(np.mean([r["rollout/reward_mean"] for r in rows]))}
    for key in SPLIT:
        out[key] = float(np.mean([r[f"time/{key}"] for r in rows]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="default")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--staleness", type=int, default=1, help="the async mode's k")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    import jax

    root = args.workdir or Path(tempfile.mkdtemp(prefix="async_vs_sync_"))
    jax.config.update("jax_compilation_cache_dir", str(root / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    overrides = SCENARIOS[args.scenario]
    if args.scenario == "gpu" and jax.default_backend() == "cpu":
        sys.exit("--scenario gpu needs a GPU (jax.default_backend() is 'cpu')")
    slow = args.scenario in ("slow-tests", "gpu")
    print(f"{args.scenario}: {args.steps} steps; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}, {platform.node()}, workdir {root}", flush=True)
    run(overrides, args.steps, 0, root / "warmup", slow)  # compiles (see the docstring)
    results = {}
    for name, k in (("sync", 0), ("async", args.staleness)):
        results[name] = run(overrides, args.steps, k, root / name, slow)
        print(f"{name} done: {results[name]['wall_s']:.1f} s", flush=True)

    cols = ("wall_s", "process_s", *SPLIT, "staleness", "overlap", "reward")
    print(f"\n{'mode':<6}" + "".join(f"{c:>15}" for c in cols))
    for name, r in results.items():
        print(f"{name:<6}" + "".join(f"{r[c]:>15.3f}" for c in cols))
    print("(per-step means except wall_s = sum of time/step_s, process_s = whole train() call)")
    print(f"speedup: {results['sync']['wall_s'] / results['async']['wall_s']:.2f}")


if __name__ == "__main__":
    main()
