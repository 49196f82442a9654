"""Sampling with NSA vs dense attention: the same tiny model (configs/model/tiny.yaml), once with
dense attention and once with `attention: nsa` (the paper's l=32, d=16, l'=64, n=16, w=512),
after long prompts. Decoding reads O(C + n*l' + w) keys per step with NSA against O(S) dense.

    PYTHONPATH=. python benchmarks/nsa_sampler.py --prompt-lens 2048,8192

Reports prefill seconds and decode tokens/s (greedy, every row generates `--new-tokens`), best
of `--repeats` after a compile run, and the ratio NSA / dense.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from pathlib import Path

import jax
import numpy as np
import yaml

from jaxagent.config import from_dict
from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig, NSAConfig
from rollouts.sampler import Sampler

TINY = Path(__file__).resolve().parents[1] / "configs" / "model" / "tiny.yaml"


def measure(cfg: ModelConfig, batch: int, prompt_len: int, new: int, repeats: int) -> dict:
    sampler = Sampler(init_model(cfg, seed=0), cache_bucket=256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    run = lambda: sampler.generate(prompts, max_new_tokens=new, temperature=0.0).stats
    run()  # compile
    stats = [run() for _ in range(repeats)]
    decode_s = min(s["seconds"] - s["prefill_seconds"] for s in stats)
    return {"prefill_s": min(s["prefill_seconds"] for s in stats),
            "decode_tok_s": batch * (new - 1) / decode_s}  # the first token comes from the prefill


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt-lens", default="2048,8192")
    p.add_argument("--batch", type=int, default=4)  # the sampler pads to 8 rows
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, help="write results as JSON here")
    args = p.parse_args()

    dense = from_dict(yaml.safe_load(TINY.read_text()), ModelConfig, source=str(TINY))
    variants = {"dense": dense, "nsa": dataclasses.replace(dense, attention="nsa", nsa=NSAConfig())}
    rows = []
    for prompt_len in (int(x) for x in args.prompt_lens.split(",")):
        row = {"prompt_len": prompt_len}
        for name, cfg in variants.items():
            row[name] = measure(cfg, args.batch, prompt_len, args.new_tokens, args.repeats)
            print(prompt_len, name, row[name], flush=True)
        row["decode_nsa_over_dense"] = row["nsa"]["decode_tok_s"] / row["dense"]["decode_tok_s"]
        rows.append(row)
    result = {"machine": f"{platform.node()} {jax.devices()[0].device_kind}", "jax": jax.__version__,
              "batch": args.batch, "new_tokens": args.new_tokens, "rows": rows}
    print(json.dumps(result, indent=1))
    for r in rows:
        print(f"prompt {r['prompt_len']}: decode tok/s dense {r['dense']['decode_tok_s']:.0f}, "
              f"nsa {r['nsa']['decode_tok_s']:.0f} ({r['decode_nsa_over_dense']:.2f}x); prefill s "
              f"dense {r['dense']['prefill_s']:.2f}, nsa {r['nsa']['prefill_s']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
