"""The `jaxagent` command line: argument parsing, then one subcommand.

Each subcommand lives in a small `_cmd_*` function; heavy imports happen inside it so that
`jaxagent --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_check_solutions(args: argparse.Namespace) -> int:
    from rollouts.check import check_solutions
    from rollouts.sandbox import Limits, SandboxUnavailable
    from rollouts.tasks import load_tasks

    try:  # bad input files or an unusable backend: one clear line, no traceback
        tasks = load_tasks(args.tasks)
        limits = Limits(wall_s=args.timeout, cpu_s=args.timeout)
        with open(args.out, "w", encoding="utf-8") as out:
            summary = check_solutions(
                tasks, args.solutions, out, args.backend, args.workers, limits
            )
    except (OSError, ValueError, SandboxUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{k}={v}" for k, v in sorted(summary.statuses.items()))
    print(f"{summary.total} results written to {args.out}: {counts}")
    for error in summary.bad_lines:
        print(f"error: {error}", file=sys.stderr)
    return 1 if summary.bad_lines else 0


def _cmd_tasks(args: argparse.Namespace) -> int:
    from rollouts.tasks import load_tasks

    try:
        tasks = load_tasks(args.tasks)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.action == "list":
        for task in tasks:
            print(f"{task.id}\t{task.entry_point}\t{len(task.tests)} tests")
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


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxagent",
        description="JAX-native RL for code-writing LLM agents.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

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

    p = sub.add_parser("tasks", help="list or show tasks of a task set")
    p.add_argument("action", choices=("list", "show"))
    p.add_argument("task_id", nargs="?", help="the task to show")
    p.add_argument(
        "--tasks",
        default="humaneval",
        help="humaneval | synthetic[:N[:SEED]] | tasks.jsonl",
    )
    p.set_defaults(func=_cmd_tasks)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "tasks" and args.action == "show" and not args.task_id:
        parser.error("tasks show: a TASK_ID is required")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
