"""Sampler throughput: jaxagent's JAX sampler vs `transformers` generate vs Tunix's sampler.

Same random Qwen3 checkpoint, same prompts (random ids), same batch and lengths, greedy
decoding with no stop token so every row generates exactly `new_tokens`. Also measures the
prefill cost of one prompt with num_samples=8 (prefix sharing) against 8 separate prompts.

    python benchmarks/sampler.py                  # tiny + ~100M configs, all peers
    python benchmarks/sampler.py --sizes tiny --peers hf

Tunix (PyPI `google-tunix`) is installed on first use into benchmarks/.venv-tunix and runs
there in a subprocess (benchmarks/_tunix_sampler.py), so its pins never touch ours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from _peers import HERE, ensure_tunix, make_checkpoint

SETTINGS = {  # (batch, prompt_len, new_tokens)
    "tiny": [(16, 64, 128), (16, 64, 512), (32, 64, 128), (32, 64, 512)],
    "100m": [(32, 64, 128)],
}


def prompts_for(batch, prompt_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, prompt_len).tolist() for _ in range(batch)]


def run_ours(ckpt: Path, settings, repeats: int, host_threads: int | None = None):
    from jaxagent.models import from_pretrained
    from rollouts.sampler import Sampler

    model = from_pretrained(ckpt, dtype="float32")
    sampler = Sampler(model, host_threads=host_threads)
    out = []
    for batch, prompt_len, new in settings:
        prompts = prompts_for(batch, prompt_len, model.config.vocab_size)
        sampler.generate(prompts, max_new_tokens=new, temperature=0.0)  # compile
        best = min(_timed(lambda: sampler.generate(prompts, max_new_tokens=new, temperature=0.0))
                   for _ in range(repeats))
        out.append(best)
    return out, sampler, model


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


def run_tunix(ckpt: Path, settings, repeats: int):
    python = ensure_tunix()
    proc = subprocess.run(
        [str(python), str(HERE / "_tunix_sampler.py"), "--checkpoint", str(ckpt),
         "--settings", json.dumps(settings), "--repeats", str(repeats)],
        capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return [float("nan")] * len(settings)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [r["seconds"] for r in rows]


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
    p.add_argument("--sizes", default="tiny,100m")
    p.add_argument("--peers", default="hf,tunix", help="besides ours on one host thread")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--out", type=Path, help="write results as JSON here")
    args = p.parse_args()
    peers = [x for x in args.peers.split(",") if x]
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, {jax.devices()[0].platform}"
    print(f"# {time.strftime('%Y-%m-%d')}  {machine}  jax {jax.__version__}")
    results = []
    for size in args.sizes.split(","):
        settings = SETTINGS[size]
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / size
            make_checkpoint(size, ckpt)
            ours, sampler, model = run_ours(ckpt, settings, args.repeats)
            # The same sampler on one host thread (CPU splits a batch over the cores).
            peer_times = {"ours-1thread": run_ours(ckpt, settings, args.repeats, 1)[0]}
            if "hf" in peers:
                peer_times["hf"] = run_hf(ckpt, settings)
            if "tunix" in peers:
                peer_times["tunix"] = run_tunix(ckpt, settings, args.repeats)
            print(f"\n## {size}: tokens/s (greedy, prompt 64)\n")
            print("| batch | new | ours | " + " | ".join(peer_times) + " | "
                  + " | ".join(f"ours/{k}" for k in peer_times) + " |")
            print("|---" * (3 + 2 * len(peer_times)) + "|")
            for i, (batch, plen, new) in enumerate(settings):
                tps = {"ours": batch * new / ours[i]}
                tps.update({k: batch * new / v[i] for k, v in peer_times.items()})
                print(f"| {batch} | {new} | {tps['ours']:,.0f} | "
                      + " | ".join(f"{tps[k]:,.0f}" for k in peer_times) + " | "
                      + " | ".join(f"{tps['ours'] / tps[k]:.2f}x" for k in peer_times) + " |")
                results.append(dict(size=size, batch=batch, prompt_len=plen, new_tokens=new,
                                    tokens_per_s=tps))
            costs = prefill_costs(sampler, model, args.prefill_len, 8, args.repeats)
            base = costs["single prompt"]
            print(f"\n## {size}: prefill of a {args.prefill_len}-token prompt\n")
            for name, sec in costs.items():
                print(f"- {name}: {sec * 1e3:.1f} ms ({sec / base:.2f}x single)")
            results.append(dict(size=size, prefill_ms={k: v * 1e3 for k, v in costs.items()}))
    if args.out:
        args.out.write_text(json.dumps(dict(machine=machine, date=time.strftime("%Y-%m-%d"),
                                            results=results), indent=2))


if __name__ == "__main__":
    main()
