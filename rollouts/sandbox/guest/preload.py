"""What the sandboxes' fork servers (the grading zygote, a bwrap session's command server) do
once so that every fork finds it done. Stdlib only: it runs inside the sandbox."""

from __future__ import annotations

import gc
import importlib
import sys


def import_pytest(pylib: list[str]) -> None:
    """Import pytest and the plugins every run of it loads (`_pytest.config.default_plugins`;
    each run imported the ones `import pytest` does not, ~5% of a run); none: a run reports it,
    as `python -m pytest` would. `pylib` is on sys.path for the imports alone."""
    saved = list(sys.path)
    sys.path.extend(pylib)
    try:
        importlib.import_module("pytest")
        from _pytest.config import default_plugins

        for name in default_plugins:
            try:
                importlib.import_module(f"_pytest.{name}")
            except Exception:  # noqa: BLE001 - a run meets it again and reports it, as pytest would
                pass
    except Exception:  # noqa: BLE001 - likewise
        pass
    finally:
        sys.path[:] = saved


def freeze() -> None:
    """Leave what this process holds out of the collections its forks run: pytest collects at
    the end of every session (its unraisable-exception check), which walked the whole
    inherited heap: over a quarter of a test run's CPU in a fork of the command server."""
    gc.collect()
    gc.freeze()
