"""LoRA against full fine-tuning: memory of the RL step, and the sampler's publish and decode.

    python benchmarks/lora.py memory      # Qwen2.5-0.5B and 7B shapes, abstract (no weights)
    python benchmarks/lora.py sampler     # a small model on this machine: publish and decode
    python benchmarks/lora.py experts     # Qwen3-30B-A3B shape: trainable bytes by target

memory: the bytes of the trainable parameters, their gradients and AdamW state, the frozen
weights, and the compiled RL step's peak (`rl_step` with a KL penalty, so full fine-tuning
holds its reference copy; XLA's memory analysis of the step lowered on abstract arrays:
arguments + outputs + temporaries - donated). Full fine-tuning keeps float32 masters; LoRA
keeps the frozen base in bfloat16 and the adapters in float32; both compute in bfloat16.

experts: the trainable bytes (float32 adapters; abstract, no weights) of a MoE model's
adapters on the attention, on the experts (gate-up fused at rank 2r, down at r: A [E, in, r'],
B [E, r', P, out] per layer) and on both, against the bfloat16 base's bytes.

sampler: `WeightStore.publish` of a training step's weights (full: every weight; LoRA: the
adapters, then merged into the sampler's base or kept beside it) and greedy decoding with
the merged and the unmerged model.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

QWEN = {
    # Qwen2.5-0.5B: tied embeddings; 7B: untied. Qwen2 layout (q/k/v biases, no q/k norm).
    "0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, head_dim=64, tie_embeddings=True),
    "7B": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
               num_heads=28, num_kv_heads=4, head_dim=128, tie_embeddings=False),
}
# Qwen3-30B-A3B: every layer sparse, 128 experts, 8 per token.
QWEN3_MOE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                 num_heads=32, num_kv_heads=4, head_dim=128, tie_embeddings=False,
                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nbytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def step_memory(shape: str, rank: int, batch: int, seq: int) -> dict:
    """Bytes of one configuration's state and its compiled RL step (abstract arrays only)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxagent.config import OptimizerConfig
    from jaxagent.models import Decoder
    from jaxagent.models.adapters import split_trainable
    from jaxagent.models.config import LoraConfig, ModelConfig
    from jaxagent.optim import make_optimizer
    from jaxagent.steps import LossOptions, TrainBatch, logits_chunk_tokens, rl_step

    cfg = ModelConfig(family="qwen2", **QWEN[shape], qk_norm=False, attention_bias=True,
                      param_dtype="bfloat16" if rank else "float32", dtype="bfloat16",
                      remat="full", lora=LoraConfig(rank=rank, alpha=2.0 * rank, targets=TARGETS))
    graphdef, weights = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    params, frozen = split_trainable(weights)
    tx = make_optimizer(OptimizerConfig(), 100)
    opt_state = jax.eval_shape(tx.init, params)
    ints, floats = (jax.ShapeDtypeStruct((batch, seq), t) for t in (jnp.int32, jnp.float32))
    data = TrainBatch(tokens=ints, targets=ints, loss_mask=floats, segment_ids=ints,
                      sampler_logprobs=floats, advantages=jax.ShapeDtypeStruct((batch,),
                                                                                jnp.float32))
    t0 = time.perf_counter()
    compiled = rl_step.lower(graphdef, tx, params, opt_state, data, params, None, frozen,
                             options=LossOptions(kl_coef=0.1),
                             logits_chunk=logits_chunk_tokens(1024, cfg.vocab_size)).compile()
    m = compiled.memory_analysis()
    return {"trainable": nbytes(params), "grads": nbytes(params), "opt_state": nbytes(opt_state),
            "frozen": nbytes(frozen) if frozen is not None else 0,
            "peak": (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                     - m.alias_size_in_bytes),
            "temp": m.temp_size_in_bytes, "compile_s": time.perf_counter() - t0}


def memory(args) -> None:
    gib = lambda b: f"{b / 2**30:8.3f}"  # noqa: E731
    print("| shape | training | trainable GiB | grads GiB | AdamW GiB | frozen GiB | "
          "trainable state vs full | step peak GiB | step temp GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        full = None
        for rank in (0, 16, 64):
            r = step_memory(shape, rank, args.batch, args.seq)
            state = r["trainable"] + r["grads"] + r["opt_state"]
            full = full or state
            name = f"LoRA r={rank}" if rank else "full"
            print(f"| {shape} | {name} | {gib(r['trainable'])} | {gib(r['grads'])} | "
                  f"{gib(r['opt_state'])} | {gib(r['frozen'])} | {100 * state / full:6.2f}% | "
                  f"{gib(r['peak'])} | {gib(r['temp'])} |", flush=True)


def expert_params(args) -> None:
    import jax
    from flax import nnx

    from jaxagent.config import OptimizerConfig
    from jaxagent.models import Decoder
    from jaxagent.models.adapters import split_trainable
    from jaxagent.models.config import LoraConfig, ModelConfig
    from jaxagent.optim import make_optimizer

    targets = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
               "experts": ("gate_proj", "up_proj", "down_proj"), "both": TARGETS}
    gib = lambda b: f"{b / 2**30:8.3f}"  # noqa: E731
    print("| shape | rank | targets | trainable GiB | trainable + grads + AdamW GiB | "
          "vs the bf16 base |")
    print("|---|---:|---|---:|---:|---:|")
    for rank in (16, 64):
        for name, names in targets.items():
            cfg = ModelConfig(family="qwen3_moe", **QWEN3_MOE, param_dtype="bfloat16",
                              lora=LoraConfig(rank=rank, alpha=2.0 * rank, targets=names))
            params, frozen = split_trainable(nnx.state(nnx.eval_shape(
                lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)))))
            trainable = nbytes(params)
            opt_state = nbytes(jax.eval_shape(make_optimizer(OptimizerConfig(), 100).init, params))
            print(f"| Qwen3-30B-A3B | {rank} | {name} | {gib(trainable)} | "
                  f"{gib(2 * trainable + opt_state)} | {100 * trainable / nbytes(frozen):5.2f}% |",
                  flush=True)


def sampler(args) -> None:
    import jax
    import numpy as np

    from jaxagent.models import init_model
    from jaxagent.models.adapters import split_trainable
    from jaxagent.models.config import LoraConfig, ModelConfig
    from jaxagent.train.sync import SamplerWeights
    from rollouts.sampler import Sampler
    from sharding.config import MeshConfig
    from sharding.layout import Layout

    base = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=8,
                       num_heads=8, num_kv_heads=2, head_dim=64)
    layout = Layout(MeshConfig())
    prompts = np.random.default_rng(0).integers(0, 4096, (args.batch, 32)).tolist()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    runs = {}
    for mode in ("full", "merged", "unmerged"):
        lora = (LoraConfig() if mode == "full" else
                LoraConfig(rank=args.rank, targets=TARGETS, sampler=mode))
        cfg = dataclasses.replace(base, lora=lora)
        graphdef, weights = layout.split(init_model(cfg))
        params, frozen = split_trainable(weights)
        params = jax.tree.map(lambda x: x + 0.01, params)  # a trained step's weights
        to_sampler = SamplerWeights.create(cfg, layout, graphdef, frozen)
        s = Sampler(to_sampler.model(params), prompt_bucket=32, cache_bucket=64)
        store = to_sampler.store(params, s.params)
        publish = lambda store=store, p=params: store.publish(0, p)
        decode = lambda s=s: s.generate(prompts, max_new_tokens=args.new_tokens, temperature=0.0)
        publish(), decode()  # compile
        runs[mode if mode == "full" else f"LoRA r={args.rank}, {mode}"] = (publish, decode)
    # Rounds over the three, so a shared machine's load falls on each alike; the best round.
    best = {name: [float("inf")] * 2 for name in runs}
    for _ in range(args.rounds):
        for name, fns in runs.items():
            best[name] = [min(b, timed(fn)) for b, fn in zip(best[name], fns)]
    print("| weights | publish ms | decode tokens/s |")
    print("|---|---:|---:|")
    for name, (publish_s, decode_s) in best.items():
        tokens_per_s = args.batch * args.new_tokens / decode_s
        print(f"| {name} | {publish_s * 1e3:8.1f} | {tokens_per_s:10.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("memory", "sampler", "experts"))
    p.add_argument("--shapes", default="0.5B,7B")
    p.add_argument("--batch", type=int, default=None, help="rows (memory: 8; sampler: 16)")
    p.add_argument("--seq", type=int, default=1024, help="memory: tokens per row")
    p.add_argument("--rank", type=int, default=16, help="sampler: the adapters' rank")
    p.add_argument("--new-tokens", type=int, default=64, help="sampler: tokens decoded per row")
    p.add_argument("--rounds", type=int, default=5, help="sampler: timed rounds (best kept)")
    args = p.parse_args()

    import jax

    print(f"{platform.node()} {platform.processor() or platform.machine()}, "
          f"{jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}")
    if args.what == "memory":
        args.batch = args.batch or 8
        memory(args)
    elif args.what == "experts":
        expert_params(args)
    else:
        args.batch = args.batch or 16
        sampler(args)


if __name__ == "__main__":
    main()
