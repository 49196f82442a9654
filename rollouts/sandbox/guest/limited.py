"""Exec a command under the solution's rlimits: `limited.py LIMITS_JSON ARGV...`.

Sessions run every tool command through this, so a shell command gets the same CPU, memory,
file-size, fd and process limits as a single-run solution.
"""

from __future__ import annotations

import json
import os
import sys

from grader import _set_limits  # the one definition of the solution's rlimits


def main() -> None:
    limits, argv = json.loads(sys.argv[1]), sys.argv[2:]
    if not argv:
        raise SystemExit("limited.py: no command given")
    _set_limits(limits)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
