"""Exec a command under the solution's rlimits: `limited.py LIMITS_JSON ARGV...`.

Sessions run every tool command through this, so a shell command gets the same confinement
(guest/confine.py: no capabilities, an unprivileged uid, seccomp) and the same CPU, memory,
file-size, fd and process limits as a single-run solution. LIMITS_JSON's "solution_uid" asks
for the confinement (the process backend leaves it out).
"""

from __future__ import annotations

import json
import os
import sys

from confine import confine, set_limits


def restrict(limits: dict) -> None:
    """Confine this process (as limits["solution_uid"], unless None) and apply `limits`."""
    if limits.get("solution_uid") is not None:
        confine(limits["solution_uid"])
    set_limits(limits)


def run(limits: dict, argv: list[str]) -> None:
    """Confine this process, apply `limits` and become `argv`."""
    if not argv:
        raise SystemExit("limited.py: no command given")
    restrict(limits)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]), sys.argv[2:])
