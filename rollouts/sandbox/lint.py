"""Lint a program with ruff, sandboxed like the solution itself (ruff only parses)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from rollouts.sandbox.launchers import Launcher

DEFAULT_RULES = ("E9", "F")  # syntax errors and pyflakes: real defects, not style


def ruff_binary() -> str:
    found = shutil.which("ruff") or shutil.which(
        "ruff", path=os.path.dirname(sys.executable)
    )
    if found is None:
        raise RuntimeError(
            "ruff not found: `pip install ruff` (needed for the lint penalty)"
        )
    return os.path.realpath(found)


def lint_issues(
    launcher: Launcher, program: str, rules: tuple[str, ...] = DEFAULT_RULES
) -> list[str]:
    """ruff's findings on `program`, as 'CODE message' strings."""
    ruff = ruff_binary()
    command = [ruff, "check", "--isolated", "--no-cache", "--output-format", "json"]
    command += ["--select", ",".join(rules), "--stdin-filename", "solution.py", "-"]
    proc = subprocess.run(
        launcher.wrap(command, binds=(ruff,)),
        input=program.encode(),
        capture_output=True,
        timeout=30,
    )
    if proc.returncode not in (0, 1):  # 1 means "issues found"
        raise RuntimeError(
            f"ruff failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-500:]}"
        )
    return [f"{d['code']} {d['message']}" for d in json.loads(proc.stdout)]
