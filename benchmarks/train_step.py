"""Train-step speed and model FLOPs utilisation (MFU) across mesh layouts.

    python benchmarks/train_step.py                 # CPU: 8 fake devices, every layout
    python benchmarks/train_step.py --gpu           # one GPU: a ~0.5B Qwen-like model in bf16

The step is `jaxagent.steps.sft_step` (forward, backward, AdamW) on a full batch of random
tokens, run under each mesh with parameters, optimizer state and batch placed by
`sharding/`. Model FLOPs per token (PaLM appendix B, no causal discount, no rematerialisation):
6 * (matmul parameters, lm_head included) + 12 * layers * heads * head_dim * seq_len.
MFU = achieved model FLOP/s / peak. GPU peak: --peak-tflops (default 989, H100 SXM dense
bf16 spec). CPU peak: measured here as the best fp32 matmul FLOP/s on one device (the fake
devices share the same cores, so the CPU numbers compare layouts, not hardware).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import time

CPU_MODEL = {"vocab_size": 1024, "hidden_size": 192, "intermediate_size": 576,
             "num_layers": 2, "num_heads": 6, "num_kv_heads": 2, "head_dim": 32}
# Qwen2.5-0.5B's shape: 494M parameters (136M of them the tied 151,936 x 896 embedding).
GPU_MODEL = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
             "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "head_dim": 64,
             "rope_theta": 1e6, "max_position_embeddings": 32768}
CPU_LAYOUTS = ["single", "data=8", "fsdp=8", "data=4,tensor=2", "fsdp=4,tensor=2",
               "data=2,fsdp=2,tensor=2", "tensor=8"]


def model_flops_per_token(cfg, seq_len: int) -> float:
    d, f, v, n, k, h = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads,
                        cfg.num_kv_heads, cfg.head_dim)
    per_layer = d * n * h * 2 + d * k * h * 2 + d * f * 3  # q, o; k, v; gate, up, down
    matmul_params = cfg.num_layers * per_layer + v * d  # + lm_head (tied or not)
    return 6 * matmul_params + 12 * cfg.num_layers * n * h * seq_len


def parse_layout(text: str):
    from sharding.config import MeshConfig

    if text == "single":
        return None
    sizes = {"data": 1}
    for part in text.split(","):
        key, _, value = part.partition("=")
        sizes[key] = int(value)
    return MeshConfig(**sizes)


def measure_peak_cpu(jnp, jax) -> float:
    """Best fp32 matmul FLOP/s on one device (TFLOP/s)."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(5))
    return 2 * n**3 / best / 1e12


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_layout(model_cfg, layout, batch: int, seq: int, steps: int, micro_batch: int,
               logits_chunk: int):
    """(compile s, median step s, temporaries' bytes); with `model_cfg.lora` the adapters
    train over the frozen base, as `jaxagent train` runs LoRA."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxagent.config import OptimizerConfig
    from jaxagent.models import init_model
    from jaxagent.models.adapters import split_trainable
    from jaxagent.optim import make_optimizer
    from jaxagent.steps import TrainBatch, sft_step
    from sharding.config import DEFAULT_AXIS_RULES
    from sharding.mesh import build_mesh
    from sharding.rules import activation_rules, place, shard_batch

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model_cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    host = TrainBatch(tokens=tokens[:, :-1], targets=tokens[:, 1:],
                      loss_mask=np.ones((batch, seq), np.float32),
                      segment_ids=np.ones((batch, seq), np.int32),
                      sampler_logprobs=np.zeros((batch, seq), np.float32),
                      advantages=np.zeros(batch, np.float32))
    tx = make_optimizer(OptimizerConfig(), 1000)
    if layout is None:
        with jax.default_device(jax.devices()[0]):
            graphdef, weights = nnx.split(init_model(model_cfg))
            params, frozen = split_trainable(weights)
            opt_state = tx.init(params)
            data = jax.device_put(host, jax.devices()[0])
        activations = contextlib.nullcontext()
    else:
        mesh = build_mesh(layout)
        graphdef, weights = nnx.split(init_model(model_cfg))
        params, frozen = split_trainable(weights)
        params, opt_state, frozen = place((params, tx.init(params), frozen), mesh,
                                          DEFAULT_AXIS_RULES)
        data = shard_batch(host, mesh, DEFAULT_AXIS_RULES)
        activations = activation_rules(mesh, DEFAULT_AXIS_RULES)
    t0 = time.perf_counter()
    with activations:  # the step is traced here: activations pinned to the mesh's layout
        step = sft_step.lower(graphdef, tx, params, opt_state, data, micro_batch,
                              logits_chunk, frozen).compile()
    memory = step.memory_analysis()  # None where the backend does not say
    temp = memory.temp_size_in_bytes if memory is not None else None
    params, opt_state, metrics = step(params, opt_state, data, frozen)
    float(metrics["sft/loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, data, frozen)
        float(metrics["sft/loss"])  # waits for the step
        times.append(time.perf_counter() - t0)
    return compile_s, sorted(times)[len(times) // 2], temp


def report(name, model_cfg, batch, seq, step_s, compile_s, temp, peak, base_s=None):
    tokens = batch * seq
    tflops = model_flops_per_token(model_cfg, seq) * tokens / step_s / 1e12
    ratio = f"{base_s / step_s:5.2f}x" if base_s else "     "
    temp = f"{temp / 2**30:8.2f}" if temp is not None else "       ?"
    print(f"{name:>24} {step_s * 1e3:10.1f} {ratio} {tokens / step_s:12.0f} {tflops:10.4f} "
          f"{100 * tflops / peak:6.1f}% {compile_s:8.1f} {temp}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="one GPU, ~0.5B model, bf16 compute")
    p.add_argument("--layouts", default=None, help="';'-separated mesh layouts, e.g. "
                                                   "'single;data=8;fsdp=4,tensor=2'")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=0, help="gradient accumulation rows")
    p.add_argument("--vocab-size", type=int, default=None, help="override the model's vocab")
    p.add_argument("--remat", default="none", choices=("none", "dots", "full"),
                   help="model.remat: what each layer keeps for the backward pass")
    p.add_argument("--steps", type=int, default=None, help="timed steps (median reported)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="GPU peak (H100 SXM dense bf16 spec: 989; ~800 is what matmuls reach)")
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="GPU mode: parameter and optimizer dtype (compute is bf16)")
    p.add_argument("--attention-backend", default="xla")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train rank-r adapters on every projection over the frozen base "
                        "(model.lora; --param-dtype is then the base's); 0: every weight")
    p.add_argument("--logits-chunk-mib", type=int, default=0,
                   help="LM-head chunks of at most this many MiB of float32 logits "
                        "(train.logits_chunk_mib); 0 = whole micro-batch")
    args = p.parse_args()
    if not args.gpu:
        # Before jax starts: 8 fake CPU devices (an edge script may set this).
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxagent.models import Decoder
    from jaxagent.models.config import LoraConfig, ModelConfig
    from jaxagent.steps import logits_chunk_tokens

    if args.gpu:
        model_cfg = ModelConfig(**GPU_MODEL, param_dtype=args.param_dtype, dtype="bfloat16",
                                attention_backend=args.attention_backend)
        batch, seq, steps = args.batch or 16, args.seq or 1024, args.steps or 10
        layouts = (args.layouts or "single").split(";")
        peak = args.peak_tflops
    else:
        model_cfg = ModelConfig(**CPU_MODEL, attention_backend=args.attention_backend)
        batch, seq, steps = args.batch or 16, args.seq or 128, args.steps or 3
        layouts = args.layouts.split(";") if args.layouts else CPU_LAYOUTS
        peak = measure_peak_cpu(jnp, jax)
    model_cfg = dataclasses.replace(model_cfg, remat=args.remat,
                                    vocab_size=args.vocab_size or model_cfg.vocab_size,
                                    lora=LoraConfig(rank=args.lora_rank))
    abstract = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    print(f"{platform.node()} {platform.processor() or platform.machine()}, "
          f"{jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}")
    print(f"model: {params / 1e6:.1f}M params, D={model_cfg.hidden_size} L={model_cfg.num_layers} "
          f"V={model_cfg.vocab_size}, param {model_cfg.param_dtype} / compute {model_cfg.dtype}; "
          f"batch {batch} x seq {seq} = {batch * seq} tokens/step; "
          f"{model_flops_per_token(model_cfg, seq) / 1e9:.3f} GFLOP/token; "
          f"peak {peak:.3f} TFLOP/s ({'given' if args.gpu else 'measured fp32 matmul'})")
    print(f"{'layout':>24} {'step ms':>10} {'vs 1st':>6} {'tokens/s':>12} {'TFLOP/s':>10} "
          f"{'MFU':>7} {'compile s':>8} {'temp GiB':>8}")
    chunk = logits_chunk_tokens(args.logits_chunk_mib, model_cfg.vocab_size)
    base = None
    for name in layouts:
        compile_s, step_s, temp = run_layout(model_cfg, parse_layout(name), batch, seq, steps,
                                             args.micro_batch, chunk)
        base = base or step_s
        report(name, model_cfg, batch, seq, step_s, compile_s, temp, peak, base)


if __name__ == "__main__":
    main()
