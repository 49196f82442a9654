"""Orbax checkpoints under `workdir/checkpoints/<step>/`: async, keep-last-N, atomic.

A checkpoint holds two items: `state`, a pytree of arrays (params, optimizer state, RNG key),
and `extra`, JSON (step, data-iterator state, finished-but-untrained rollouts, anything small).
Orbax writes into a temporary directory and renames it when complete, so a kill during a save
leaves the previous newest checkpoint as the newest complete one. A complete checkpoint that
no longer restores (a truncated or damaged file) is set aside, never deleted, and the next
newest one is used (`restore_newest`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxagent.errors import UserError


class CheckpointError(UserError):
    """No checkpoint in a directory that has some restores."""


def _one_line(e: BaseException) -> str:
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:200]}"


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True),
            item_names=("state", "extra"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, extra: dict) -> None:
        """Start saving (returns before the write ends when async); `wait()` to block."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)))

    def restore(self, step: int, like: Any, *, partial: bool = False) -> tuple[Any, dict]:
        """Restore `step` with the structure, shapes, dtypes and shardings of `like`; with
        `partial`, `like` may name only some of the saved arrays (the rest are not read)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        state = (ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True) if partial else ocp.args.StandardRestore(abstract))
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=state, extra=ocp.args.JsonRestore()))
        return out["state"], out["extra"]

    def restore_newest(self, like: Any, report: Callable[[str], None] = print, *,
                       set_aside: bool = True, partial: bool = False
                       ) -> tuple[int, Any, dict] | None:
        """(step, state, extra) of the newest checkpoint that restores, None when there is none.

        A newer one that fails is reported through `report` in one line and, with `set_aside`
        (a run that will save again), moved to `<directory>.corrupt/<step>` (kept for
        inspection; out of the way of the next save of that step). When every checkpoint
        fails, CheckpointError says so in one line.
        """
        failed = []
        try:
            for step in sorted(self._manager.all_steps(), reverse=True):
                try:
                    state, extra = self.restore(step, like, partial=partial)
                except Exception as e:  # orbax and tensorstore raise many types for damaged files
                    kept = f"moved to {self._set_aside(step)}" if set_aside else "skipped"
                    report(f"checkpoint step {step} does not restore ({_one_line(e)}); "
                           f"{kept}, trying the previous one")
                    failed.append(step)
                    continue
                return step, state, extra
        finally:
            if failed and set_aside:  # the manager's list of steps no longer holds them
                self._manager.reload()
        if failed:
            where = f" and were moved to {self.directory}.corrupt" if set_aside else ""
            raise CheckpointError(f"{self.directory}: no checkpoint restores (steps "
                                  f"{', '.join(map(str, failed))} failed{where})")
        return None

    def _set_aside(self, step: int) -> Path:
        target = Path(f"{self.directory}.corrupt") / str(step)
        target.parent.mkdir(exist_ok=True)
        if target.exists():  # the same step failed before: keep both
            target = target.with_name(f"{step}-{len(list(target.parent.iterdir()))}")
        shutil.move(str(self.directory / str(step)), target)
        return target

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
