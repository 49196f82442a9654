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
    from jaxagent.config import load_config

    return load_config(args.config, args.overrides)


def load_model_and_tokenizer(cfg, checkpoint: str | None = None):
    """The HF checkpoint (with its tokenizer) if one is given, else `cfg.model` at random init
    with the byte tokenizer."""
    from pathlib import Path

    from jaxagent.models import from_pretrained, init_model
    from jaxagent.tokenizer import ByteTokenizer, HFTokenizer

    checkpoint = checkpoint or cfg.checkpoint
    if checkpoint is None:
        return init_model(cfg.model, seed=cfg.seed), ByteTokenizer()
    model = from_pretrained(checkpoint, dtype=cfg.model.param_dtype, compute_dtype=cfg.model.dtype)
    if (Path(checkpoint) / "tokenizer.json").exists():
        return model, HFTokenizer(checkpoint)
    if model.config.vocab_size < ByteTokenizer.vocab_size:
        raise SystemExit(f"{checkpoint}: no tokenizer.json, and the vocabulary is too small "
                         "for the byte tokenizer")
    return model, ByteTokenizer()


def _cmd_generate(args) -> int:
    from rich.console import Console

    from rollouts.sampler import Sampler

    console = Console(stderr=True)
    cfg = _load_config(args)
    model, tokenizer = load_model_and_tokenizer(cfg, args.model)
    if args.model is None and cfg.checkpoint is None:
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
