"""Sandboxed execution of untrusted solutions with verdicts they cannot forge.

Backends: `bwrap` (default), `docker`, `process` (no isolation, opt-in). See
docs/sandbox.md for the threat model. This package is an I/O edge: it must not
import jax or model code.
"""

from rollouts.sandbox.launchers import SandboxUnavailable
from rollouts.sandbox.pool import Sandbox
from rollouts.sandbox.types import (
    STATUSES,
    Limits,
    RunRequest,
    RunResult,
    Status,
    TestCase,
)

__all__ = [
    "STATUSES",
    "Limits",
    "RunRequest",
    "RunResult",
    "Sandbox",
    "SandboxUnavailable",
    "Status",
    "TestCase",
]
