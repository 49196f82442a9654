"""Does RL make the multi-turn agent better, and does the multi-turn part matter?

Runs `configs/agent_default.yaml` (SFT warm-up on scripted demonstrations, then GRPO on tool
episodes over the embedded agent family) per seed and variant, each in its own workdir, then
reads the runs' `metrics.jsonl` and evaluates their first (post-warm-up) and last checkpoints
again with the episode cut to one turn (`agent.max_turns=1`: the same model answering without
tools; the family's tasks hide the needed fact from the prompt, so it can only guess). Prints
one table row per run and the medians:

    held-out pass@1 after the warm-up -> after RL (the gain), the one-turn pass@1 before and
    after, solved episodes that ran the tests before finishing, bad calls per episode over
    the first and last steps, wall-clock minutes.

    PYTHONPATH=. python benchmarks/agent_learning.py --seeds 0 1 2
    PYTHONPATH=. python benchmarks/agent_learning.py --seeds 0 --variant feedback_off \
        feedback_on feedback_script feedback_grammar --out runs/agent_learning   # targeted
        # feedback off, on (the policy reading a hint; the scripted teacher; the grammar teacher)
    PYTHONPATH=. python benchmarks/agent_learning.py --seeds 0 1 2 \
        --config configs/agent_bpe.yaml --out runs/agent_bpe_learning  # a learnt BPE
    PYTHONPATH=. python benchmarks/agent_learning.py --seeds 0 1 2 \
        --warmup runs/agent_default/checkpoints/0   # RL only, from one finished warm-up
    PYTHONPATH=. python benchmarks/agent_learning.py --seeds 0 1 2 \
        --config configs/agent_bpe.yaml --out runs/turns8 agent.max_turns=8 \
        --warmup 'runs/agent_bpe_learning/base-{seed}/checkpoints/0'  # each seed's own

A run that already finished in `--out` is read, not rerun (delete its folder to rerun).
`--warmup` starts every run from the same post-warm-up checkpoint (the warm-up is most of a
run's time, and its seed would otherwise differ between the runs compared), or with `{seed}` in
it from each seed's own. Either way the resumed run's step 0 is evaluated again under the run's
own config, as its overrides may change what an episode is (`agent.max_turns`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# `base`: the config as it is; the feedback variants set the targeted feedback either way, with
# the policy reading a hint, the task's scripted demonstration or the call grammar as the
# teacher (at the betas measured in docs/agent.md); `guided`: every failed group's worst episode
# replaced by the task's scripted demonstration (off-policy guidance); `uncached`: every
# `run_tests` runs (no `agent.test_cache`: the same episodes, slower); `batch16`: 16 tasks a
# step for half the steps (the same episodes in fewer, larger updates)
VARIANTS = {
    "base": [],
    "guided": ["agent.guidance=1.0"],
    "uncached": ["agent.test_cache=false"],
    "batch16": ["train.prompts_per_step=16", "train.steps=30", "eval.every=15"],
    "feedback_off": ["agent.feedback_beta=0"],
    "feedback_on": ["agent.feedback_detectors=[bad_tool_call,test_edit,repeat]",
                    "agent.feedback_beta=0.1"],
    "feedback_script": ["agent.feedback_detectors=[bad_tool_call]", "agent.feedback_beta=0.005",
                        "agent.feedback_teacher=script"],
    "feedback_grammar": ["agent.feedback_detectors=[bad_tool_call]", "agent.feedback_beta=0.001",
                         "agent.feedback_teacher=grammar"],
}


def train(config: str, workdir: Path, seed: int, overrides: list[str],
          warmup: Path | None = None) -> float:
    """Minutes of wall clock for one `jaxagent train` (those recorded, when it finished before).
    With `warmup` (a post-warm-up checkpoint, step 0), the run resumes from a copy of it (and of
    its run's learnt tokenizer, if any)."""
    done = workdir / "done"
    if done.exists():
        return float(done.read_text())
    if warmup is not None and not (workdir / "checkpoints" / "0").exists():
        shutil.copytree(warmup, workdir / "checkpoints" / "0")
        learnt = warmup.parent.parent / "tokenizer"  # model.tokenizer: bpe reads its ids there
        if learnt.is_dir():
            shutil.copytree(learnt, workdir / "tokenizer")
    from jaxagent.config import load_config

    cfg = load_config(config, [f"seed={seed}", *overrides])
    # every checkpoint kept: the one-turn evaluations read the first and the last
    keep = f"checkpoint.keep={cfg.train.steps // max(cfg.checkpoint.every, 1) + 2}"
    t0 = time.perf_counter()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open(workdir.parent / f"{workdir.name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", "--config", config,
                        f"seed={seed}", f"workdir={workdir}", *overrides, keep],
                       check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    minutes = (time.perf_counter() - t0) / 60
    done.write_text(f"{minutes:.2f}")
    return minutes


def held_out(workdir: Path, step: int, max_turns: int | None = None) -> dict[str, float]:
    """The held-out evaluation (`eval/pass@1`, `eval/agent/...`) of the run's checkpoint at
    `step` under the run's config, or with episodes cut to `max_turns` (1: the one-turn
    policy)."""
    from contextlib import closing

    from flax import nnx

    from jaxagent.checkpoint import Checkpointer
    from jaxagent.config import load_config
    from jaxagent.optim import make_optimizer
    from jaxagent.train.build import (load_agent_splits, load_model_and_tokenizer, make_sampler,
                                      make_scorer)
    from jaxagent.train.evaluate import evaluate_agent

    cfg = load_config(workdir / "config.yaml")
    if max_turns is not None:
        cfg = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, max_turns=max_turns))
    model, tokenizer = load_model_and_tokenizer(cfg)
    graphdef, params = nnx.split(model)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    like = {"params": params, "opt_state": tx.init(params),
            **({"ref_params": params} if cfg.rl.kl_coef else {})}
    with closing(Checkpointer(workdir / "checkpoints")) as ckpt:
        state, _ = ckpt.restore(step, like)
    sampler = make_sampler(nnx.merge(graphdef, state["params"]), tokenizer, cfg)
    with make_scorer(cfg) as scorer:
        scores, _ = evaluate_agent(cfg, sampler, tokenizer, scorer,
                                   load_agent_splits(cfg)[1], samples=cfg.eval.samples,
                                   ks=(1,), temperature=cfg.eval.temperature, seed=cfg.seed)
    return scores


def summarize(workdir: Path, minutes: float) -> dict:
    """One run's row; a run resumed from a warm-up checkpoint (which logs no evaluation at
    step 0) has that checkpoint evaluated here under the run's own config."""
    from jaxagent.metrics import read_metrics

    rows = read_metrics(workdir / "metrics.jsonl")
    evals = [r for r in rows if "eval/pass@1" in r]
    if evals[0]["step"] != 0:
        evals = [{"step": 0, **held_out(workdir, 0)}, *evals]
    steps = [r for r in rows if "train/loss" in r]
    first, last = evals[0], evals[-1]
    k = max(1, len(steps) // 5)  # bad calls: the first and last fifth of the steps

    def bad(rs):
        return statistics.mean(r["agent/bad_tool_calls"] / max(r["agent/episodes"], 1)
                               for r in rs)

    return {
        "pass@1_warm": first["eval/pass@1"], "pass@1_rl": last["eval/pass@1"],
        "gain": last["eval/pass@1"] - first["eval/pass@1"],
        "one_turn_warm": held_out(workdir, first["step"], max_turns=1)["eval/pass@1"],
        "one_turn_rl": held_out(workdir, last["step"], max_turns=1)["eval/pass@1"],
        "tested_first_warm": first.get("eval/agent/solved_tested_first", float("nan")),
        "tested_first_rl": last.get("eval/agent/solved_tested_first", float("nan")),
        "bad_calls_first": bad(steps[:k]), "bad_calls_last": bad(steps[-k:]),
        "steps": len(steps), "minutes": minutes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/agent_default.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variant", choices=VARIANTS, nargs="+", default=["base"])
    p.add_argument("--warmup", help="a run's post-warm-up checkpoint (WORKDIR/checkpoints/0): "
                   "every run starts RL from a copy of it; {seed} in it: each seed's own")
    p.add_argument("--out", type=Path, default=Path("runs/agent_learning"))
    p.add_argument("--jsonl", type=Path, help="append one JSON row per run here")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    warmups = {seed: Path(str(a.warmup).format(seed=seed)) for seed in a.seeds} if a.warmup else {}
    for warmup in warmups.values():
        if not (warmup / "_CHECKPOINT_METADATA").exists():
            p.error(f"--warmup {warmup}: not a checkpoint (no _CHECKPOINT_METADATA)")
    print(f"# {platform.node()} {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, "
          f"{a.config} {' '.join(a.overrides)}")
    cols = ("pass@1_warm", "pass@1_rl", "gain", "one_turn_warm", "one_turn_rl",
            "tested_first_warm", "tested_first_rl", "bad_calls_first", "bad_calls_last",
            "steps", "minutes")
    print("variant       seed " + " ".join(f"{c:>17}" for c in cols))
    for variant in a.variant:
        results = []
        for seed in a.seeds:
            workdir = a.out / f"{variant}-{seed}"
            workdir.mkdir(parents=True, exist_ok=True)
            minutes = train(a.config, workdir, seed, [*VARIANTS[variant], *a.overrides],
                            warmups.get(seed))
            row = summarize(workdir, minutes)
            results.append(row)
            print(f"{variant:<13} {seed:>4} " + " ".join(f"{row[c]:>17.3f}" for c in cols),
                  flush=True)
            if a.jsonl:
                with a.jsonl.open("a") as f:
                    f.write(json.dumps({"variant": variant, "seed": seed, "config": a.config,
                                        "overrides": a.overrides, **row}) + "\n")
        print(f"{variant:<13} {'med':>4} " + " ".join(
            f"{statistics.median(r[c] for r in results):>17.3f}" for c in cols))


if __name__ == "__main__":
    main()
