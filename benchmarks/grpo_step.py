"""Wall time of one whole GRPO step: jaxagent vs Tunix's GRPOLearner, side by side.

One step = generate G completions per prompt, score them, one policy update, and hand the new
weights to the sampler. Both stacks run the same random HF Qwen3 checkpoint (the tiny config:
2 layers, d_model 128, vocab 4096, float32), the same 4 prompts of 32 random token ids, G=4,
64 new tokens (temperature 1, no stop token, so every row is exactly 64 tokens), the same
in-process reward (fraction of even token ids, _peers.even_fraction), GRPO advantages, no KL,
one update per step with AdamW (lr 1e-5, b2 0.95, global-norm clip 1.0), token-mean loss.

- jaxagent: rollouts.sampler.Sampler.generate (prompt prefilled once, shared by its G samples)
  -> reward -> jaxagent.rl.grpo_advantages -> jaxagent.steps.pack_shared + rl_step ->
  sampler.update_weights, blocking on the new params before the clock stops. pack_shared is
  what `jaxagent train` does by default (train.share_prompt): each group is one row, its
  prompt computed once; `--no-share-prompt` packs one row per completion (jaxagent.steps.pack).
- Tunix (PyPI google-tunix, in its own venv at benchmarks/.venv-tunix, installed on first use):
  GRPOLearner.train over an RLCluster on one CPU device, actor and rollout on the same mesh
  (shared weights, no sync), vanilla rollout engine, beta=0 (no reference model),
  num_iterations=1. It runs in a subprocess (benchmarks/_tunix_grpo.py); step boundaries and
  the generate / reward split come from wrapping the learner's own calls, "train" is the rest.

Each stack runs `--warmup` steps first (compilation), then `--steps` timed steps; the table
shows medians (each column its own median, so the split need not add up exactly).

    python benchmarks/grpo_step.py                       # both stacks, 2 warm-up + 10 steps
    python benchmarks/grpo_step.py --no-tunix --steps 5
    python benchmarks/grpo_step.py --tunix-python /path/to/venv/bin/python --out results.json

The aim (issue 28): jaxagent's step <= 0.6x Tunix's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from _peers import HERE, ensure_tunix, even_fraction, make_checkpoint, run_worker

SPLIT = ("generate", "reward", "train")


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for _ in range(n)]


def run_ours(ckpt: Path, prompts, group: int, new_tokens: int, warmup: int, steps: int,
             lr: float, dtype: str, share_prompt: bool = True,
             attention_backend: str = "xla") -> list[dict]:
    from flax import nnx

    import jaxagent
    from jaxagent.config import OptimizerConfig
    from jaxagent.models import from_pretrained
    from jaxagent.optim import make_optimizer
    from jaxagent.steps import LossOptions, logits_chunk_tokens, pack, pack_shared, rl_step
    from rollouts.sampler import Sampler

    model = from_pretrained(ckpt, dtype="float32", compute_dtype=dtype,
                            attention_backend=attention_backend)
    sampler = Sampler(model)
    graphdef, params = nnx.split(model)
    tx = make_optimizer(OptimizerConfig(learning_rate=lr), 100)
    opt_state = tx.init(params)
    options = LossOptions()
    chunk = logits_chunk_tokens(1024, model.config.vocab_size)
    rows = [p for p in prompts for _ in range(group)]  # num_samples rows per prompt, in order
    before = [np.array(x, copy=True) for x in jax.tree.leaves(params)]
    out = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        gen = sampler.generate(prompts, num_samples=group, max_new_tokens=new_tokens,
                               temperature=1.0, seed=step)
        t1 = time.perf_counter()
        rewards = np.array([even_fraction(t) for t in gen.tokens], np.float32)
        advantages = np.asarray(jaxagent.rl.grpo_advantages(rewards.reshape(len(prompts), group)))
        t2 = time.perf_counter()
        if share_prompt:
            batch = pack_shared(rows, gen.tokens, gen.logprobs, advantages.reshape(-1),
                                group_size=group)
        else:
            batch = pack(rows, gen.tokens, gen.logprobs, advantages.reshape(-1))
        # The LM head in 1 GiB chunks, as `jaxagent train` does (train.logits_chunk_mib): whole,
        # 64 rows x 512 tokens x a 151,936 vocabulary asked an H200 for 106 GiB.
        params, opt_state, _ = rl_step(graphdef, tx, params, opt_state, batch, options=options,
                                       logits_chunk=chunk)
        sampler.update_weights(params)
        jax.block_until_ready(params)
        t3 = time.perf_counter()
        out.append({"step": step, "seconds": t3 - t0, "generate": t1 - t0, "reward": t2 - t1,
                    "train": t3 - t2})
    changed = max(float(np.abs(np.asarray(a) - b).max())
                  for a, b in zip(jax.tree.leaves(params), before, strict=True))
    if not changed > 0:
        raise RuntimeError("jaxagent: the update left the parameters unchanged")
    return out[warmup:]


def run_tunix(python: Path, ckpt: Path, prompts, group: int, new_tokens: int, warmup: int,
              steps: int, lr: float, dtype: str, timeout: float | None = None,
              micro_batch: int = 0) -> tuple[list[dict] | None, str]:
    """Tunix's timed steps, or (None, reason) when its learner could not run."""
    cmd = [str(python), str(HERE / "_tunix_grpo.py"), "--checkpoint", str(ckpt),
           "--prompts", json.dumps(prompts), "--group", str(group), "--new-tokens",
           str(new_tokens), "--warmup", str(warmup), "--steps", str(steps), "--lr", str(lr),
           "--dtype", dtype, "--micro-batch", str(micro_batch)]
    rows, reason = run_worker(cmd, timeout)
    timed = [r for r in rows if "step" in r][warmup:]
    if reason:  # steps that finished before a timeout still count
        return (timed or None), reason
    changed = next((r["max_param_change"] for r in rows if "max_param_change" in r), 0.0)
    if not changed > 0:
        return None, "its update left the parameters unchanged"
    return timed, ""


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in ("seconds", *SPLIT)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="tiny")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="G completions per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-tunix", action="store_true", help="measure jaxagent only")
    p.add_argument("--no-ours", action="store_true", help="measure Tunix only (its worker then "
                   "has the GPU to itself: at 0.5B its train step asked for 62 GiB at once)")
    p.add_argument("--no-share-prompt", action="store_true",
                   help="jaxagent packs one row per completion (prompt recomputed G times)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="activations (parameters and AdamW stay float32)")
    p.add_argument("--tunix-timeout", type=float, default=None, help="seconds")
    p.add_argument("--tunix-micro-batch", type=int, default=0,
                   help="prompts per Tunix gradient-accumulation micro-batch (0: all at once; "
                        "at 0.5B, 8 x G 8 x 512 tokens at once asked an H200 for 70 GiB)")
    p.add_argument("--attention-backend", default="auto",
                   help="jaxagent's model.attention_backend (auto: on a GPU the document kernel "
                        "for the shared-prompt rows and the prefill, XLA for decode steps; "
                        "else XLA). XLA attention keeps [rows, heads, L, L] scores per layer for "
                        "the backward: at 0.5B with 8 x (256 + 8 x 256)-token shared-prompt rows "
                        "an H200 was asked for 99 GiB")
    p.add_argument("--tunix-python", type=Path,
                   help="python of a venv with google-tunix (default: benchmarks/.venv-tunix, "
                        "created on first use)")
    p.add_argument("--out", type=Path, help="write results as JSON here")
    args = p.parse_args()

    machine = (f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
               f"{jax.devices()[0].platform}, jax {jax.__version__}")
    print(f"# {time.strftime('%Y-%m-%d')}  {machine}  load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(f"# {args.size} Qwen3, {args.prompts} prompts x G={args.group}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; median of {args.steps} steps after {args.warmup} warm-up; "
          f"jaxagent packing: {'one row per completion' if args.no_share_prompt else 'shared prompt'}\n")
    results = {}
    reason = ""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / args.size
        make_checkpoint(args.size, ckpt, "float32")
        with open(ckpt / "config.json") as f:
            vocab = json.load(f)["vocab_size"]
        prompts = make_prompts(args.prompts, args.prompt_len, vocab)
        common = (prompts, args.group, args.new_tokens, args.warmup, args.steps, args.lr,
                  args.dtype)
        backend = args.attention_backend
        if not args.no_ours:
            results["jaxagent"] = run_ours(ckpt, *common, share_prompt=not args.no_share_prompt,
                                           attention_backend=backend)
            print(json.dumps({"stack": "jaxagent", "median": medians(results["jaxagent"])}),
                  flush=True)
        if not args.no_tunix:
            python = args.tunix_python or ensure_tunix()
            tunix, reason = run_tunix(python, ckpt, *common, timeout=args.tunix_timeout,
                                      micro_batch=args.tunix_micro_batch)
            if tunix is None:
                print(f"tunix: unavailable: {reason}")
            else:
                results["tunix"] = tunix
                if reason:
                    print(f"tunix: {len(tunix)} timed steps only ({reason})")

    summary = {name: medians(rows) for name, rows in results.items()}
    print("| stack | s/step | generate | reward | train |")
    print("|---|---:|---:|---:|---:|")
    for name, m in summary.items():
        print(f"| {name} | {m['seconds']:.3f} | " + " | ".join(f"{m[k]:.3f}" for k in SPLIT) + " |")
    if "tunix" in summary and "jaxagent" in summary:
        ours, theirs = summary["jaxagent"], summary["tunix"]
        ratio = ours["seconds"] / theirs["seconds"]
        print(f"\njaxagent / Tunix step time: {ratio:.2f}x (aim <= 0.6x); by part: "
              + ", ".join(f"{k} {ours[k] / theirs[k]:.2f}x" for k in SPLIT))
    if args.out:
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": machine, "load": os.getloadavg(),
            "setting": vars(args) | {"out": str(args.out), "tunix_python": str(args.tunix_python)},
            "median": summary, "steps": results, "tunix_unavailable": reason or None}, indent=2))


if __name__ == "__main__":
    main()
