import io
import json

from rich.console import Console
from rich.progress import TextColumn

from jaxagent.metrics import LogProgress, curve_series, plot_curves, read_metrics, trim_jsonl


def _plain_lines(every_s):
    out = io.StringIO()
    with LogProgress(TextColumn("{task.description}"), console=Console(file=out),
                     every_s=every_s) as progress:
        task = progress.add_task("rl", total=4, info="")
        for i in range(4):
            progress.update(task, advance=1, info=f"reward {i}")
    return [line for line in out.getvalue().splitlines() if "/" in line]


def test_progress_prints_plain_lines_when_not_a_terminal():
    lines = _plain_lines(every_s=0)  # one per step
    assert [line.split(" (")[0] for line in lines] == ["rl 1/4", "rl 2/4", "rl 3/4", "rl 4/4"]
    assert lines[0].endswith("reward 0") and lines[3].endswith("reward 3")
    # at most one per every_s, and the one that finishes the task
    assert [line.split(" (")[0] for line in _plain_lines(every_s=3600)] == ["rl 1/4", "rl 4/4"]
    on_terminal = io.StringIO()
    console = Console(file=on_terminal, force_terminal=True)
    with LogProgress(TextColumn("{task.description}"), console=console, every_s=0) as progress:
        progress.update(progress.add_task("rl", total=1, info=""), advance=1)
    assert "rl 1/1" not in on_terminal.getvalue()  # bars, not lines


def test_trim_jsonl_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 2}\n{"step": 3}\n{"step": 4, "te')
    trim_jsonl(path, 2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 2]
    trim_jsonl(path, None)
    assert path.read_text() == ""


def test_curve_series_expands_prefixes_into_lines(tmp_path):
    rows = [{"step": 1, "agent/tool_calls/read_file": 3.0, "agent/tool_calls/finish": 1.0,
             "rollout/pass_rate": 0.25},
            {"step": 2, "agent/tool_calls/read_file": 5.0, "rollout/pass_rate": None},
            {"step": 3, "eval/pass@1": 0.5, "agent/tool_calls": 9.0}]
    panels = curve_series(rows, ("eval/pass@1", "agent/tool_calls/*", "rollout/pass_rate",
                                 "agent/turns_mean", "eval/agent/pass_rate/*"))
    # keys without data have no panel; `agent/tool_calls` itself is not under the prefix
    assert list(panels) == ["eval/pass@1", "agent/tool_calls/*", "rollout/pass_rate"]
    assert panels["agent/tool_calls/*"] == {"finish": [(1, 1.0)],
                                            "read_file": [(1, 3.0), (2, 5.0)]}
    assert panels["rollout/pass_rate"] == {"rollout/pass_rate": [(1, 0.25)]}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_curves(path, tmp_path / "curves.png", ("eval/pass@1", "agent/tool_calls/*"))
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert plot_curves(path, tmp_path / "none.png", ("agent/turns_mean",)) is None
