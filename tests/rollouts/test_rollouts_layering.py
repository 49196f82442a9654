"""Layering rules: the sandbox and task code are I/O edges that never pull in jax."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["rollouts.sandbox", "rollouts.tasks", "rollouts.rewards", "rollouts.check", "rollouts.tools",
     "rollouts.agent"],
)
def test_importing_does_not_import_jax_or_start_anything(module):
    code = (
        f"import sys, threading; import {module}; "
        "assert 'jax' not in sys.modules, 'jax imported'; "
        "assert threading.active_count() == 1, 'threads started at import'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
