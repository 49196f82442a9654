"""The `jaxagent` command line: argument parsing, then one subcommand.

Each subcommand lives in a small `_cmd_*` function; heavy imports happen inside it so that
`jaxagent --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxagent",
        description="JAX-native RL for code-writing LLM agents.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
