"""Sampler throughput: jaxagent's JAX sampler vs `transformers` generate vs Tunix's sampler.

Same random Qwen3 checkpoint, same prompts (random ids), same batch and lengths, greedy
decoding with no stop token so every row generates exactly `new_tokens`. Also measures the
prefill cost of one prompt with num_samples=8 (prefix sharing) against 8 separate prompts.

    python benchmarks/sampler.py                  # tiny + ~100M configs, all peers
    python benchmarks/sampler.py --sizes tiny --peers hf
    python benchmarks/sampler.py --gpu --tunix-python python3 --jsonl out.jsonl   # one GPU

Tunix (PyPI `google-tunix`) is installed on first use into benchmarks/.venv-tunix and runs
there in a subprocess (benchmarks/_tunix_sampler.py), so its pins never touch ours
(`--tunix-python` names an interpreter that already has it, e.g. a GPU machine's).

`--gpu`: Qwen2.5-0.5B and -1.5B dimensions, bf16 parameters and activations, batch 1/16/64,
prompt 512, 128 and 1,024 new tokens, ours vs Tunix. Besides tokens/s it reports how close our
decode comes to the memory-bandwidth limit: a decode step must read every weight but the input
embedding (one row per sequence) and every cached K and V; those bytes over the device's
bandwidth (a device-to-device copy measured in the same run, and the datasheet figure) give the
fastest possible step, and the fraction is that over our measured step (decode time / steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from _peers import HERE, ensure_tunix, make_checkpoint, run_worker

SETTINGS = {  # (batch, prompt_len, new_tokens)
    "tiny": [(16, 64, 128), (16, 64, 512), (32, 64, 128), (32, 64, 512)],
    "100m": [(32, 64, 128)],
    # GPU: the short generations first, so a cut-off run still has every batch size.
    "qwen2.5-0.5b": [(1, 512, 128), (16, 512, 128), (64, 512, 128), (16, 512, 1024),
                     (64, 512, 1024), (1, 512, 1024)],
    "qwen2.5-1.5b": [(1, 512, 128), (16, 512, 128), (64, 512, 128), (16, 512, 1024)],
}
# HBM bandwidth by datasheet, bytes/s (the copy measured in the run is the other reference).
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100": 3.35e12}


def prompts_for(batch, prompt_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, prompt_len).tolist() for _ in range(batch)]


def run_ours(ckpt: Path, settings, repeats: int, host_threads: int | None = None,
             dtype: str = "float32", on_result=None, seconds_left: float | None = None,
             trace: Path | None = None, attention_backend: str = "auto"):
    """Best seconds per setting (and the sampler); `on_result(setting, seconds, stats)` is
    called as each setting finishes; settings not started within `seconds_left` are NaN.
    `trace`: a perfetto trace of 32 new tokens at the first setting goes to that folder."""
    from jaxagent.models import from_pretrained
    from rollouts.sampler import Sampler

    deadline = time.perf_counter() + (seconds_left or float("inf"))
    model = from_pretrained(ckpt, dtype=dtype, attention_backend=attention_backend)
    sampler = Sampler(model, host_threads=host_threads)
    out = []
    for batch, prompt_len, new in settings:
        if time.perf_counter() > deadline:
            out.append(float("nan"))
            continue
        prompts = prompts_for(batch, prompt_len, model.config.vocab_size)
        sampler.generate(prompts, max_new_tokens=new, temperature=0.0)  # compile
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = sampler.generate(prompts, max_new_tokens=new, temperature=0.0)
            runs.append((time.perf_counter() - t0, result.stats))
        best, stats = min(runs, key=lambda r: r[0])
        if on_result is not None:
            on_result((batch, prompt_len, new), best, stats)
        out.append(best)
        if trace is not None:
            with jax.profiler.trace(str(trace), create_perfetto_trace=True):
                sampler.generate(prompts, max_new_tokens=min(new, 32), temperature=0.0)
            trace = None
    return out, sampler, model


def measure_bandwidth(gib: float = 2.0, repeats: int = 10) -> float:
    """Device memory bandwidth, bytes/s: a jitted copy of `gib` GiB, bytes read + written."""
    import jax.numpy as jnp

    n = int(gib * 2**30) // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)  # one read, one write; a plain copy may be elided
    copy(x).block_until_ready()
    best = min(_timed(lambda: copy(x).block_until_ready()) for _ in range(repeats))
    return 2 * n * 4 / best


def decode_bytes(hf: dict, batch: int, prompt_len: int, new: int, itemsize: int = 2) -> float:
    """Bytes one decode step must read at the mean cache length: every weight but the input
    embedding (an untied table is read one row per sequence), and each row's cached K and V."""
    d, f, v, L = (hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"],
                  hf["num_hidden_layers"])
    n, k, h = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    per_layer = d * n * h * 2 + d * k * h * 2 + d * f * 3 + 2 * d + 2 * h
    weights = L * per_layer + d + v * d  # + final norm + LM head
    cached = prompt_len + new / 2
    kv = 2 * L * k * h * cached * batch
    return (weights + kv) * itemsize


def _append(path: Path | None, row: dict) -> None:
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_hf(ckpt: Path, settings):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    for batch, prompt_len, new in settings:
        ids = torch.tensor(prompts_for(batch, prompt_len, model.config.vocab_size))
        kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None,
                      attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, **kwargs)  # warm-up
            t = _timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                              **kwargs))
        out.append(t)
    return out


def run_tunix(ckpt: Path, settings, repeats: int, python: Path | None = None,
              dtype: str = "float32", timeout: float | None = None):
    """Tunix's best seconds per setting (NaN for settings it did not finish)."""
    rows, reason = run_worker(
        [str(python or ensure_tunix()), str(HERE / "_tunix_sampler.py"), "--checkpoint",
         str(ckpt), "--settings", json.dumps(settings), "--repeats", str(repeats),
         "--dtype", dtype], timeout)
    if reason:
        print(f"tunix: {reason}", file=sys.stderr)
    seconds = {(r["batch"], r["prompt_len"], r["new_tokens"]): r["seconds"] for r in rows}
    return [seconds.get(tuple(s), float("nan")) for s in settings]


def prefill_costs(sampler, model, prompt_len: int, group: int, repeats: int):
    """Seconds of prefill: one prompt, one prompt x `group` samples shared, `group` separate."""
    from rollouts.sampler import Sampler

    prompt = prompts_for(1, prompt_len, model.config.vocab_size, seed=1)
    separate = Sampler(model, prefix_sharing=False)
    cases = {
        "single prompt": (sampler, 1),
        f"1 prompt x {group} samples (shared prefill)": (sampler, group),
        f"{group} separate prefills": (separate, group),
    }
    out = {}
    for name, (s, n) in cases.items():
        s.generate(prompt, num_samples=n, max_new_tokens=1)  # compile
        out[name] = min(s.generate(prompt, num_samples=n, max_new_tokens=1)
                        .stats["prefill_seconds"] for _ in range(repeats))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpu", action="store_true",
                   help="GPU sizes and settings, bf16, Tunix as the peer, bandwidth fractions")
    p.add_argument("--sizes", default=None, help="default: tiny,100m (--gpu: the Qwen2.5 sizes)")
    p.add_argument("--peers", default=None, help="besides ours (default: hf,tunix and ours on "
                   "one host thread; --gpu: tunix)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--settings", type=json.loads, default=None,
                   help='JSON [[batch, prompt_len, new_tokens], ...] instead of the size\'s own')
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--tunix-python", type=Path, help="an interpreter with google-tunix "
                   "(default: benchmarks/.venv-tunix, created on first use)")
    p.add_argument("--ours-timeout", type=float, default=None,
                   help="seconds per size after which ours starts no further setting")
    p.add_argument("--tunix-timeout", type=float, default=None, help="seconds per size")
    p.add_argument("--label", default="ours",
                   help="our rows' stack name (e.g. the XLA_FLAGS variant a run tries)")
    p.add_argument("--no-ours", action="store_true", help="time the peers only")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="keep the random checkpoints here (made once, reused by later runs)")
    p.add_argument("--trace", type=Path, help="perfetto trace of our first setting (32 tokens)")
    p.add_argument("--attention-backend", default="auto",
                   help="our model.attention_backend (xla: the prefill before it ran the kernel)")
    p.add_argument("--out", type=Path, help="write results as JSON here")
    p.add_argument("--jsonl", type=Path, help="append one JSON line per result as it comes")
    args = p.parse_args()
    sizes = args.sizes or ("qwen2.5-0.5b,qwen2.5-1.5b" if args.gpu else "tiny,100m")
    if args.peers is None:
        args.peers = "tunix" if args.gpu else "hf,tunix"
    peers = [x for x in args.peers.split(",") if x]  # "" or ",": ours alone
    dtype = "bfloat16" if args.gpu else "float32"
    device = jax.devices()[0]
    machine = (f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
               f"{device.platform} {device.device_kind}")
    print(f"# {time.strftime('%Y-%m-%d')}  {machine}  jax {jax.__version__}  {dtype}")
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=machine, jax=jax.__version__,
                dtype=dtype)
    bandwidth = datasheet = None
    if args.gpu:
        bandwidth = measure_bandwidth()
        datasheet = next((v for k, v in DATASHEET_BANDWIDTH.items() if k in device.device_kind),
                         None)
        print(f"# copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); datasheet "
              f"{datasheet and datasheet / 1e12} TB/s")
        _append(args.jsonl, dict(meta, kind="bandwidth", bytes_per_s=bandwidth,
                                 datasheet_bytes_per_s=datasheet))
    results = []
    for size in sizes.split(","):
        settings = [tuple(x) for x in args.settings] if args.settings else SETTINGS[size]
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = (args.checkpoint_dir or Path(tmp)) / f"{size}-{dtype}"
            if not (ckpt / "config.json").exists():
                make_checkpoint(size, ckpt, dtype)
            hf = json.loads((ckpt / "config.json").read_text())

            def ours_done(setting, seconds, stats, size=size, hf=hf):
                batch, plen, new = setting
                row = dict(meta, kind="sampler", stack=args.label, size=size, batch=batch,
                           prompt_len=plen, new_tokens=new, seconds=seconds,
                           tokens_per_s=batch * new / seconds,
                           prefill_s=stats.get("prefill_seconds"))
                if bandwidth:
                    step = (seconds - stats["prefill_seconds"]) / new
                    need = decode_bytes(hf, batch, plen, new)
                    row.update(decode_step_ms=step * 1e3, bytes_per_step=need,
                               bandwidth_fraction=need / bandwidth / step,
                               datasheet_fraction=datasheet and need / datasheet / step)
                print(json.dumps(row), flush=True)
                _append(args.jsonl, row)

            if args.no_ours:
                ours, sampler, model = [float("nan")] * len(settings), None, None
            else:
                ours, sampler, model = run_ours(ckpt, settings, args.repeats, dtype=dtype,
                                                on_result=ours_done,
                                                seconds_left=args.ours_timeout, trace=args.trace,
                                                attention_backend=args.attention_backend)
            peer_times = {}
            if not args.gpu and not args.no_ours:  # one host thread (CPU splits a batch)
                peer_times["ours-1thread"] = run_ours(ckpt, settings, args.repeats, 1)[0]
            if "hf" in peers:
                peer_times["hf"] = run_hf(ckpt, settings)
            if "tunix" in peers:
                peer_times["tunix"] = run_tunix(ckpt, settings, args.repeats, args.tunix_python,
                                                dtype, args.tunix_timeout)
            print(f"\n## {size}: tokens/s (greedy)\n")
            print("| batch | prompt | new | ours | " + " | ".join(peer_times) + " | "
                  + " | ".join(f"ours/{k}" for k in peer_times) + " |")
            print("|---" * (4 + 2 * len(peer_times)) + "|")
            for i, (batch, plen, new) in enumerate(settings):
                tps = {"ours": batch * new / ours[i]}
                tps.update({k: batch * new / v[i] for k, v in peer_times.items()})
                print(f"| {batch} | {plen} | {new} | {tps['ours']:,.0f} | "
                      + " | ".join(f"{tps[k]:,.0f}" for k in peer_times) + " | "
                      + " | ".join(f"{tps['ours'] / tps[k]:.2f}x" for k in peer_times) + " |")
                row = dict(size=size, batch=batch, prompt_len=plen, new_tokens=new,
                           tokens_per_s=tps)
                results.append(row)
                if peer_times:
                    _append(args.jsonl, dict(meta, kind="sampler-peers", **row))
            if not args.gpu:
                costs = prefill_costs(sampler, model, args.prefill_len, 8, args.repeats)
                base = costs["single prompt"]
                print(f"\n## {size}: prefill of a {args.prefill_len}-token prompt\n")
                for name, sec in costs.items():
                    print(f"- {name}: {sec * 1e3:.1f} ms ({sec / base:.2f}x single)")
                results.append(dict(size=size, prefill_ms={k: v * 1e3 for k, v in costs.items()}))
            del sampler, model
    if args.out:
        args.out.write_text(json.dumps(dict(meta, results=results), indent=2))


if __name__ == "__main__":
    main()
