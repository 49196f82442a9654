"""Peer measurement: Tunix's GRPOLearner, one step per batch (runs in Tunix's own venv).

Drives `GRPOLearner.train` for warmup + steps global steps on one CPU device (actor and
rollout share one mesh, so they share weights and there is no weight sync), no reference
model (beta=0), one policy epoch (num_iterations=1). Prints one JSON line per step:
{"step", "seconds", "generate", "reward", "train"}; "train" is the rest of the step
(completion padding, the policy update, metrics bookkeeping). Called by benchmarks/grpo_step.py.
"""

import argparse
import json
import time

import jax
import numpy as np
import optax
from _peers import IdTokenizer, even_fraction, load_tunix_qwen3
from flax import nnx
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout


def reward_fn(prompts, completions, **kwargs):
    """The benchmark's reward on Tunix's decoded completions (space-separated ids)."""
    return [even_fraction([int(t) for t in text.split()]) for text in completions]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of prompts (lists of token ids)")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", default="float32", help="activations (parameters stay float32)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="prompts per gradient-accumulation micro-batch (Tunix's "
                        "train_micro_batch_size; 0: the whole batch at once)")
    args = p.parse_args()
    prompts = json.loads(args.prompts)
    prompt_len = max(len(x) for x in prompts)
    total = args.warmup + args.steps

    model, _ = load_tunix_qwen3(args.checkpoint, "float32", args.dtype)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # Same optimizer as jaxagent.optim.make_optimizer(OptimizerConfig(learning_rate=lr)).
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(args.lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0))
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=tx, eval_every_n_steps=10**9, max_steps=total,
            # one optimizer update per step either way; micro-batches accumulate its gradient
            **({"mini_batch_size": len(prompts), "train_micro_batch_size": args.micro_batch}
               if args.micro_batch else {})),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=args.new_tokens, max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + args.new_tokens + 8, temperature=1.0, top_p=1.0,
            top_k=None, eos_tokens=[-1]),
    )
    cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=IdTokenizer(),
                                       cluster_config=cluster_config)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=args.group, num_iterations=1,
                                            beta=0.0, epsilon=0.2, loss_agg_mode="token-mean"),
        reward_fns=reward_fn)

    # Step boundaries and the split come from wrapping the learner's own calls.
    starts, split = [], []

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            split[-1][key] += time.perf_counter() - t0
            return out
        setattr(obj, name, wrapper)

    run_global_step = learner._run_global_step

    def global_step(*a, **kw):
        # A fresh sampling seed per step, as jaxagent's side does (Tunix's default is PRNGKey(0)).
        cluster_config.rollout_config.seed = len(starts)
        starts.append(time.perf_counter())
        split.append({"generate": 0.0, "reward": 0.0})
        return run_global_step(*a, **kw)

    learner._run_global_step = global_step
    timed(cluster, "generate", "generate")
    timed(learner, "_compute_rewards", "reward")

    before = [np.array(x, copy=True) for x in jax.tree.leaves(nnx.state(cluster.actor_trainer.model))]
    batch = {"prompts": np.array([" ".join(map(str, x)) for x in prompts])}
    learner.train([batch] * total)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    starts.append(time.perf_counter())
    after = jax.tree.leaves(nnx.state(cluster.actor_trainer.model))
    changed = max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(after, before))
    print(json.dumps({"max_param_change": changed,
                      "train_steps": cluster.actor_trainer.train_steps}), flush=True)
    for i, s in enumerate(split):
        seconds = starts[i + 1] - starts[i]
        print(json.dumps({"step": i, "seconds": seconds, **s,
                          "train": seconds - s["generate"] - s["reward"]}), flush=True)


if __name__ == "__main__":
    main()
