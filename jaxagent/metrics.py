"""Run metrics: `workdir/metrics.jsonl` (one object per line: `step` + namespaced keys),
TensorBoard event files, a PNG of the reward and eval curves, and progress that shows in a log
file as well as on a terminal.

Only the writer's owner (process 0 in a multi-host run) should write; others pass
`enabled=False` and every call becomes a no-op.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rich.progress import Progress


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a kill: everything before it is intact
    return rows


def trim_jsonl(path: str | Path, last_step: int | None) -> None:
    """Keep the rows of a run's JSONL log up to step `last_step` (a resume's checkpoint); None
    keeps none (a fresh run). Rows trained after the checkpoint, and a line cut short by a
    kill, are dropped, so a resumed run logs each step once."""
    path = Path(path)
    rows = [] if last_step is None else [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class MetricsWriter:
    """Appends metrics rows; on resume from `resume_step`, rows of later steps (trained after
    the last checkpoint, before a crash) are dropped so each step appears once."""

    def __init__(self, workdir: str | Path, *, resume_step: int | None = None,
                 enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        trim_jsonl(self.path, resume_step)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"), purge_step=(
                resume_step + 1 if resume_step is not None else None))

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)}
        for key, value in metrics.items():
            value = float(value)
            row[key] = value if math.isfinite(value) else None
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and value is not None:
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def curve_series(rows: list[dict], keys) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{panel: {line: [(step, value), ...]}} for the keys that have data. A key ending in `/*`
    is a panel of every key under that prefix, one line each (a tool mix, a pass rate per
    template); any other key is a panel of one line."""
    panels = {}
    for key in keys:
        if key.endswith("/*"):
            prefix = key[:-1]
            names = sorted({k for r in rows for k in r if k.startswith(prefix)})
        else:
            names = [key]
        lines = {name[len(key) - 1:] if key.endswith("/*") else name:
                 [(r["step"], r[name]) for r in rows if r.get(name) is not None] for name in names}
        lines = {name: points for name, points in lines.items() if points}
        if lines:
            panels[key] = lines
    return panels


def plot_curves(metrics_path: str | Path, out: str | Path,
                keys=("rollout/reward_mean", "rollout/pass_rate", "eval/pass@1")) -> Path | None:
    """A PNG with one panel per key that has data (`curve_series`), three to a row; None if no
    key has any."""
    import matplotlib

    matplotlib.use("Agg")  # no display; keep the choice local to this call's backend
    import matplotlib.pyplot as plt

    panels = curve_series(read_metrics(metrics_path), keys)
    if not panels:
        return None
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (key, lines) in zip(axes.flat, panels.items()):
        for name, points in lines.items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None,
                    label=name if len(lines) > 1 else None)
        if len(lines) > 1:
            ax.legend(fontsize=7)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


class LogProgress(Progress):
    """Rich progress bars on a terminal; elsewhere (a log file, CI, `nohup`), where bars are
    drawn only at the end, one plain line per task at most every `every_s` seconds (and when a
    task finishes), so a log shows progress as it happens."""

    def __init__(self, *columns, every_s: float = 10.0, **kwargs):
        super().__init__(*columns, **kwargs)
        self.every_s = every_s
        self._printed: dict = {}

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._plain(task_id)

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._plain(task_id)

    def _plain(self, task_id) -> None:
        if self.disable or self.console.is_terminal:
            return
        task, now = self._tasks[task_id], time.monotonic()
        if now - self._printed.get(task_id, -math.inf) < self.every_s and not task.finished:
            return
        self._printed[task_id] = now
        total = f"/{task.total:.0f}" if task.total is not None else ""
        info = task.fields.get("info", "")
        self.console.print(f"{task.description} {task.completed:.0f}{total} "
                           f"({task.elapsed or 0:.0f}s) {info}".rstrip(), highlight=False)
