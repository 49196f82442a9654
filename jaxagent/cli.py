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

    from jaxagent.train.build import make_sampler, sampling_layout
    from jaxagent.train.evaluate import load_policy
    from sharding.distributed import initialize, is_leader

    cfg = _load_config(args)
    # across processes every one samples the same prompt with the model sharded over all
    initialize(cfg.distributed)
    console = Console(stderr=True, quiet=not is_leader())
    layout = sampling_layout(cfg)
    # an HF directory, or a run's workdir (its newest checkpoint, with the run's own config)
    model, tokenizer, cfg = load_policy(cfg, args.model, layout, args.overrides)
    if args.model is None and cfg.init_from is None:
        console.print("[yellow]No --model or checkpoint: sampling the tiny default model at "
                      "random init.[/yellow]")
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    prompt = tokenizer.encode(text, add_bos=tokenizer.add_bos)
    s = cfg.sampler
    sampler = make_sampler(model, tokenizer, cfg, layout.sampler_activations)
    out = sampler.generate(
        [prompt], num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens or s.max_new_tokens,
        temperature=s.temperature if args.temperature is None else args.temperature,
        top_k=s.top_k, top_p=s.top_p, stop_token_ids=tokenizer.stop_ids, seed=cfg.seed)
    if not is_leader():
        return 0
    for i, completion in enumerate(out.texts):
        if args.num_samples > 1:
            print(f"--- sample {i} ({out.finish_reasons[i]})")
        print(completion)
    st = out.stats
    console.print(f"[dim]{st['generated_tokens']} tokens in {st['seconds']:.2f}s[/dim]")
    return 0


def _cmd_agent(args) -> int:
    import json

    from jaxagent.train.build import (
        load_agent_tasks,
        load_model_and_tokenizer,
        make_sampler,
        make_scorer,
        sampling_layout,
        tool_env_factory,
    )
    from rollouts.agent.metrics import agent_metrics
    from rollouts.agent.rollout import run_episodes
    from rollouts.sampler import continuation

    cfg = _load_config(args)
    a, s = cfg.agent, cfg.sampler
    tasks = load_agent_tasks(cfg)
    layout = sampling_layout(cfg)
    model, tokenizer = load_model_and_tokenizer(cfg, None, layout, sampling=True)
    sampler = make_sampler(model, tokenizer, cfg, layout.sampler_activations)
    cont = continuation(sampler, a.episodes, max_new_tokens=a.max_action_tokens,
                        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                        stop_token_ids=tokenizer.stop_ids, seed=cfg.seed)
    n = args.episodes or len(tasks)
    episodes = [tasks[i % len(tasks)] for i in range(n)]
    with make_scorer(cfg) as scorer:
        make_env = tool_env_factory(cfg, tokenizer, scorer)
        envs = [make_env() for _ in range(a.episodes)]
        try:
            trajs = run_episodes(cont, envs, episodes)
        finally:
            for env in envs:
                env.close()
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps({"task_id": t.task_id, "reward": t.reward, "info": t.info,
                                     "text": tokenizer.decode(t.tokens[t.prompt_len:])}) + "\n"
                         for t in trajs)
    for key, value in agent_metrics(trajs, episodes).items():
        print(f"{key}\t{value:g}")
    return 0


def _cmd_train(args) -> int:
    from jaxagent.train.loop import train

    train(_load_config(args))
    return 0


def _cmd_sft(args) -> int:
    import json

    from rich.console import Console

    from jaxagent.train.sft import run_sft

    out = run_sft(_load_config(args))
    metrics = json.loads((out / "sft_metrics.json").read_text())
    Console(stderr=True).print(f"SFT model written to {out}; " + ", ".join(
        f"{k} {v:.4f}" for k, v in metrics.items()))
    return 0


def _cmd_export(args) -> int:
    from jaxagent.train.evaluate import run_export

    out = run_export(_load_config(args), args.checkpoint, args.out, merge=args.merge,
                     overrides=args.overrides)
    print(f"written to {out}")
    return 0


def _cmd_eval(args) -> int:
    import json

    from jaxagent.errors import UserError
    from jaxagent.train.evaluate import run_eval
    from sharding.distributed import is_leader

    try:
        ks = [int(k) for k in args.k.split(",")]
    except ValueError:
        raise UserError(f"--k {args.k}: expected comma-separated whole numbers, e.g. 1,5") from None
    if min(ks) < 1:
        raise UserError(f"--k {args.k}: every k must be >= 1")
    if args.samples is not None and (args.samples < 1 or args.samples < max(ks)):
        raise UserError(f"--samples {args.samples}: pass@{max(ks)} needs at least {max(ks)} "
                        "samples per task")
    cfg = _load_config(args)
    scores, rows = run_eval(cfg, checkpoint=args.checkpoint, tasks=args.tasks, ks=ks,
                            samples=args.samples, overrides=args.overrides)
    if not is_leader():  # every process has every row; process 0 reports them
        return 0
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    for key, value in scores.items():
        print(f"{key}: {value:.4f}")
    return 0


def _cmd_check_solutions(args: argparse.Namespace) -> int:
    from rollouts.check import check_solutions, same_file
    from rollouts.sandbox import Limits, SandboxUnavailable
    from rollouts.tasks import load_tasks

    if not args.timeout > 0:
        print(f"error: --timeout: must be > 0 seconds, got {args.timeout}", file=sys.stderr)
        return 2
    if same_file(args.out, args.tasks):
        print(f"error: --out {args.out}: is the --tasks file; write the results elsewhere",
              file=sys.stderr)
        return 2
    try:  # bad input files or an unusable backend: one clear line, no traceback
        tasks = load_tasks(args.tasks)
        limits = Limits(wall_s=args.timeout, cpu_s=args.timeout)
        summary = check_solutions(tasks, args.solutions, args.out, args.backend, args.workers,
                                  limits)
    except (OSError, ValueError, SandboxUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{k}={v}" for k, v in sorted(summary.statuses.items()))
    print(f"{summary.total} results written to {args.out}: {counts}")
    for error in summary.bad_lines:
        print(f"error: {error}", file=sys.stderr)
    return 1 if summary.bad_lines else 0


def _cmd_make_deletion(args: argparse.Namespace) -> int:
    import shlex

    from rollouts.tasks.deletion import Target, make_deletion_tasks

    try:
        features = [[Target.parse(t) for t in f.split(",")] for f in args.feature] or None
        made, skipped = make_deletion_tasks(
            args.task_id, args.out, shlex.split(args.test_command), args.test_paths.split(","),
            features, backend=args.backend)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for m in made:
        print(f"{m.task_id}\t{len(m.targets)} target tests\t{' '.join(map(str, m.feature))}")
    for why in skipped:
        print(f"skipped: {why}", file=sys.stderr)
    return 0 if made else 1


def _cmd_tasks(args: argparse.Namespace) -> int:
    from rollouts.tasks import load_tasks

    if args.action == "make-deletion":
        return _cmd_make_deletion(args)
    if args.action == "check":
        return _cmd_check_tasks(args)
    if args.action == "stats":
        return _cmd_task_stats(args)

    try:
        tasks = load_tasks(args.tasks)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not tasks:
        print(f"error: {args.tasks}: no tasks", file=sys.stderr)
        return 1
    if args.action == "list":
        for task in tasks:
            tests = task.metadata.get("target_tests", ()) if task.repo else task.tests
            print(f"{task.id}\t{task.entry_point}\t{len(tests)} tests\tgrading: {task.grading}")
        return 0
    found = [t for t in tasks if t.id == args.task_id]
    if not found:
        print(f"error: no task {args.task_id!r} in {args.tasks}", file=sys.stderr)
        return 1
    task = found[0]
    print(
        f"# {task.id} (entry point: {task.entry_point}, {len(task.tests)} tests)\n{task.prompt}"
    )
    for case in task.tests:
        print(f"# {case.name}\n{case.code}")
    return 0


def _cmd_check_tasks(args: argparse.Namespace) -> int:
    from rollouts.check import check_tasks
    from rollouts.sandbox import SandboxUnavailable
    from rollouts.tasks import load_tasks

    spec = args.task_id or args.tasks
    try:
        tasks = load_tasks(spec)
        problems = check_tasks(tasks, backend=args.backend)
    except (OSError, ValueError, SandboxUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(line)
    print(f"{len(tasks)} tasks checked in {spec}: "
          + (f"{len(problems)} problems" if problems else "every reference passes, no leak"),
          file=sys.stderr)
    return 1 if problems else 0


def _cmd_task_stats(args: argparse.Namespace) -> int:
    import statistics

    from rollouts.check import task_stats
    from rollouts.sandbox import SandboxUnavailable
    from rollouts.tasks import load_tasks

    spec = args.task_id or args.tasks
    try:
        rows = task_stats(load_tasks(spec), backend=args.backend)
    except (OSError, ValueError, SandboxUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {spec}: no tasks", file=sys.stderr)
        return 1
    keys = ["task", "target_tests", "functions", "body_lines", "reference_passes"]
    print("\t".join(keys))
    for row in rows:
        print("\t".join(str(row.get(k, "-")) for k in keys))
    graded = [r["reference_passes"] for r in rows if "reference_passes" in r]
    print(f"{len(rows)} tasks: target tests per task median "
          f"{statistics.median(r['target_tests'] for r in rows):g}, body lines median "
          f"{statistics.median(r['body_lines'] for r in rows):g}, references passing "
          f"{sum(graded)}/{len(graded)}", file=sys.stderr)
    return 0


def _cmd_sandbox(args: argparse.Namespace) -> int:
    """`sandbox build-image`: the docker backend's image, offline (rollouts/sandbox/image.py)."""
    import subprocess

    from rollouts.sandbox import SandboxUnavailable
    from rollouts.sandbox.image import host_image, image_with_requirements

    if args.requirements and not args.tag:
        print("error: --requirements needs --tag (the image to make)", file=sys.stderr)
        return 2
    try:
        base = args.base or host_image()
        if args.requirements:
            tag = image_with_requirements(base, args.requirements, args.tag, args.find_links)
        else:
            tag = args.tag or base
            if tag != base:
                subprocess.run(["docker", "tag", base, tag], check=True)
    except (OSError, SandboxUnavailable, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tag)
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
    p.add_argument("--model", help="HF checkpoint directory (config.json + *.safetensors), a "
                                    "PEFT adapter directory, or a training run's workdir (its "
                                    "newest checkpoint)")
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

    p = sub.add_parser("agent", help="run multi-turn tool episodes and print agent metrics",
                       description="Run agent.episodes tool episodes at a time over the "
                                   "agent.tasks repository tasks (the config's model) and print "
                                   "the agent/... metrics.")
    p.add_argument("--episodes", type=int, help="episodes in all (default: one per task)")
    p.add_argument("--out", help="write each episode (task, reward, info, text) as JSONL here")
    _add_config_args(p)
    p.set_defaults(func=_cmd_agent, default_config="configs/agent_tiny.yaml")

    p = sub.add_parser("sft", help="supervised fine-tuning on reference solutions",
                       description="Run `sft.steps` of SFT on the tasks' references and save "
                                   "an HF checkpoint to WORKDIR/sft.")
    _add_config_args(p)
    p.set_defaults(func=_cmd_sft, default_config="configs/default.yaml")

    p = sub.add_parser("eval", help="pass@k of a checkpoint on a task set",
                       description="pass@k on the config's held-out tasks (or --tasks). With "
                                   "agent.enabled, plays tool episodes and adds the eval/agent/... "
                                   "metrics (turns, tool mix, bad calls, truncation, test edits, "
                                   "solved episodes that ran the tests first).")
    p.add_argument("--checkpoint", help="HF checkpoint dir, PEFT adapter dir or a run's "
                                        "workdir (its newest checkpoint); default: the config's "
                                        "model")
    p.add_argument("--tasks", default=None, help="humaneval | synthetic[:N[:SEED]] | FILE.jsonl "
                                                 "| a directory of deletion tasks (agent configs)")
    p.add_argument("--k", default="1", help="comma-separated k values")
    p.add_argument("--samples", type=int, default=None, help="completions per task")
    p.add_argument("--out", help="write per-sample results as JSONL here")
    _add_config_args(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("export", help="write a policy as files other programs load",
                       description="Write a run's newest checkpoint (or an HF / PEFT directory) "
                                   "as an HF checkpoint; a LoRA policy as a PEFT adapter "
                                   "directory, or with --merge as a full HF checkpoint with the "
                                   "adapters merged in.")
    p.add_argument("--checkpoint", required=True, help="a run's workdir, an HF checkpoint dir "
                                                       "or a PEFT adapter dir")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--merge", action="store_true", help="merge adapters into the weights")
    _add_config_args(p)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "check-solutions",
        help="grade completions in the sandbox, one JSON result per line",
    )
    p.add_argument(
        "--tasks", required=True, help="humaneval | synthetic[:N[:SEED]] | tasks.jsonl"
    )
    p.add_argument(
        "--solutions", required=True, help='JSONL of {"task_id", "completion"} lines'
    )
    p.add_argument(
        "--out", required=True, help="JSONL results, same order as --solutions"
    )
    p.add_argument("--backend", choices=("bwrap", "docker", "process"), default="bwrap")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="parallel sandboxes (default: CPU count)",
    )
    p.add_argument(
        "--timeout", type=float, default=10.0, help="wall and CPU seconds per solution"
    )
    p.set_defaults(func=_cmd_check_solutions)

    p = sub.add_parser("tasks", help="list, show or check tasks of a task set; make deletion tasks",
                       description="`tasks make-deletion REPO --out DIR`: repository tasks made "
                                   "by deleting function bodies whose tests then fail. `tasks "
                                   "check SET`: every reference solution passes its tests in the "
                                   "sandbox, and no deletion task holds a copy of its answer. "
                                   "`tasks stats SET`: target tests, code asked for and "
                                   "reference pass per task.")
    p.add_argument("action", choices=("list", "show", "check", "stats", "make-deletion"))
    p.add_argument("task_id", nargs="?", help="the task to show (make-deletion: the repository; "
                                              "check, stats: the task set, default --tasks)")
    p.add_argument("--out", help="make-deletion: directory to write the tasks into")
    p.add_argument("--feature", action="append", default=[],
                   help="make-deletion: comma-separated PATH::QUALNAME deleted together "
                        "(repeatable; default: one task per documented function)")
    p.add_argument("--test-command", default="python -m pytest tests",
                   help="make-deletion: the repository's test command")
    p.add_argument("--test-paths", default="tests", help="make-deletion: comma-separated test dirs")
    p.add_argument("--backend", choices=("bwrap", "process"), default="bwrap",
                   help="make-deletion, check and stats: sandbox backend for the test runs")
    p.add_argument(
        "--tasks",
        default="humaneval",
        help="humaneval | synthetic[:N[:SEED]] | tasks.jsonl",
    )
    p.set_defaults(func=_cmd_tasks)

    p = sub.add_parser("sandbox", help="build the docker backend's sandbox image, offline",
                       description="`sandbox build-image`: without --base, a minimal image made "
                                   "from this host's interpreter and core tools (no registry); "
                                   "with --requirements, those packages installed by the host's "
                                   "pip into /pylib of the base. Prints the image's tag; the "
                                   "engine is the one DOCKER_HOST names.")
    p.add_argument("action", choices=("build-image",))
    p.add_argument("--base", help="a local image to start from (default: the host-made one)")
    p.add_argument("--requirements", help="a requirements file to install into /pylib")
    p.add_argument("--find-links", help="a folder of wheels: install from it alone (offline)")
    p.add_argument("--tag", help="the image's tag (default: jaxagent-sandbox:CONTENT_KEY)")
    p.set_defaults(func=_cmd_sandbox)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jaxagent.errors import UserError
    from rollouts.tasks.task import TaskFormatError

    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "tasks" and args.action == "show" and not args.task_id:
        parser.error("tasks show: a TASK_ID is required")
    if args.command == "tasks" and args.action == "make-deletion" and not (args.task_id and args.out):
        parser.error("tasks make-deletion: REPO and --out DIR are required")
    try:
        return int(args.func(args) or 0)
    except (UserError, TaskFormatError) as e:
        print(f"jaxagent: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # one line, not a traceback from wherever the signal landed
        print(f"jaxagent: {args.command} interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
