"""Orbax checkpoints under `workdir/checkpoints/<step>/`: async, keep-last-N, atomic.

A checkpoint holds two items: `state`, a pytree of arrays (params, optimizer state, RNG key),
and `extra`, JSON (step, data-iterator state, finished-but-untrained rollouts, anything small).
Orbax writes into a temporary directory and renames it when complete, so a kill during a save
leaves the previous newest checkpoint as the newest complete one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


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

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore `step` with the structure, shapes, dtypes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()))
        return out["state"], out["extra"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
