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
    args = ["check", "--isolated", "--no-cache", "--output-format", "json"]
    args += ["--select", ",".join(rules), "--stdin-filename", "solution.py", "-"]
    argv = launcher.tool_argv(ruff_binary(), args)
    proc = subprocess.run(
        argv, input=program.encode(), capture_output=True, timeout=30, check=False
    )
    try:  # exit status 1 just means "issues found"; a failed start prints no JSON
        findings = json.loads(proc.stdout)
    except json.JSONDecodeError:
        stderr = proc.stderr.decode(errors="replace")[-500:]
        raise RuntimeError(f"ruff failed (exit {proc.returncode}): {stderr}") from None
    return [f"{d['code']} {d['message']}" for d in findings]
