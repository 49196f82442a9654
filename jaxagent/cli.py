"""The `jaxagent` command line: argument parsing, then one subcommand.

Each subcommand lives in a small `_cmd_*` function; heavy imports happen inside it so that
`jaxagent --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (configs/...); defaults: the tiny run")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. model.num_layers=4 workdir=/tmp/run")


def _load_config(args):
    from pathlib import Path

    from jaxagent.config import load_config

    path = args.config
    default = getattr(args, "default_config", None)
    if path is None and default and Path(default).is_file():
        path = default
    return load_config(path, args.overrides)


def _cmd_generate(args) -> int:
    from rich.console import Console

    from jaxagent.trainer import load_model_and_tokenizer
    from rollouts.sampler import Sampler

    console = Console(stderr=True)
    cfg = _load_config(args)
    model, tokenizer = load_model_and_tokenizer(cfg, args.model)
    if args.model is None and cfg.init_from is None:
        console.print("[yellow]No --model or checkpoint: sampling the tiny default model at "
                      "random init.[/yellow]")
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    prompt = tokenizer.encode(text, add_bos=getattr(tokenizer, "add_bos", False))
    s = cfg.sampler
    sampler = Sampler(model, tokenizer, prompt_bucket=s.prompt_bucket,
                      cache_bucket=s.cache_bucket, batch_bucket=s.batch_bucket)
    out = sampler.generate(
        [prompt], num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens or s.max_new_tokens,
        temperature=s.temperature if args.temperature is None else args.temperature,
        top_k=s.top_k, top_p=s.top_p, stop_token_ids=tokenizer.stop_ids, seed=cfg.seed)
    for i, completion in enumerate(out.texts):
        if args.num_samples > 1:
            print(f"--- sample {i} ({out.finish_reasons[i]})")
        print(completion)
    st = out.stats
    console.print(f"[dim]{st['generated_tokens']} tokens in {st['seconds']:.2f}s[/dim]")
    return 0


def _cmd_train(args) -> int:
    from jaxagent.trainer import train

    train(_load_config(args))
    return 0


def _cmd_sft(args) -> int:
    from rich.console import Console

    from jaxagent.trainer import run_sft

    out = run_sft(_load_config(args))
    Console(stderr=True).print(f"SFT model written to {out}")
    return 0


def _cmd_eval(args) -> int:
    import json

    from jaxagent.trainer import run_eval

    cfg = _load_config(args)
    scores, rows = run_eval(cfg, checkpoint=args.checkpoint, tasks=args.tasks,
                            ks=[int(k) for k in args.k.split(",")], samples=args.samples)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    for key, value in scores.items():
        print(f"{key}: {value:.4f}")
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxagent",
        description="JAX-native RL for code-writing LLM agents.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("generate", help="sample a completion from a model",
                       description="Sample completions of a prompt (tiny default model "
                                   "without --model).")
    p.add_argument("--model", help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--num-samples", type=int, default=1)
    _add_config_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("train", help="RL training (SFT warm-up, then GRPO/RLOO); resumes",
                       description="Train with the config (default: configs/default.yaml when "
                                   "present, else the built-in defaults). Re-running the same "
                                   "command resumes from the newest checkpoint.")
    _add_config_args(p)
    p.set_defaults(func=_cmd_train, default_config="configs/default.yaml")

    p = sub.add_parser("sft", help="supervised fine-tuning on reference solutions",
                       description="Run `sft.steps` of SFT on the tasks' references and save "
                                   "an HF checkpoint to WORKDIR/sft.")
    _add_config_args(p)
    p.set_defaults(func=_cmd_sft, default_config="configs/default.yaml")

    p = sub.add_parser("eval", help="pass@k of a checkpoint on a task set")
    p.add_argument("--checkpoint", help="HF checkpoint dir or a run's workdir (its newest "
                                        "checkpoint); default: the config's model")
    p.add_argument("--tasks", default=None, help="humaneval | synthetic[:N[:SEED]] | FILE.jsonl")
    p.add_argument("--k", default="1", help="comma-separated k values")
    p.add_argument("--samples", type=int, default=None, help="completions per task")
    p.add_argument("--out", help="write per-sample results as JSONL here")
    _add_config_args(p)
    p.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jaxagent.errors import UserError

    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"jaxagent: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
