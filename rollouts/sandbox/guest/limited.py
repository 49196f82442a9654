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

from confine import confine
from grader import _set_limits  # the one definition of the solution's rlimits


def main() -> None:
    limits, argv = json.loads(sys.argv[1]), sys.argv[2:]
    if not argv:
        raise SystemExit("limited.py: no command given")
    if limits.get("solution_uid") is not None:
        confine(limits["solution_uid"])
    _set_limits(limits)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
