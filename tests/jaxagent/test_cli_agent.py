"""`jaxagent agent`: tool episodes of the tiny model on CPU end to end; the agent configs load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxagent.cli import main as cli
from jaxagent.config import load_config
from jaxagent.metrics import read_metrics


def test_agent_configs_load():
    tiny = load_config("configs/agent_tiny.yaml")
    assert tiny.agent.enabled and tiny.agent.call_format == "compact"
    assert tiny.agent.max_turns == 4
    default = load_config("configs/agent_default.yaml")
    assert default.agent.tasks.startswith("embedded:") and default.sft.data == "agent"
    assert default.agent.max_turns >= 6 and default.agent.truncation == "penalty"
    # positive-sample reinforcement: the setting measured to raise held-out pass@1
    assert default.rl.negative_scale == 0 and default.optim.learning_rate == 3e-4
    big = load_config("configs/agent_qwen2.5-coder-7b.yaml")
    assert big.agent.call_format == "hermes" and big.init_from.startswith("/checkpoints/")


@pytest.mark.slow  # ~15 s on a quiet 2-core machine (compiles a ~2.5k-token prefill), 90 s loaded
def test_agent_command_runs_multi_turn_episodes_on_cpu(tmp_path, capsys):
    out = tmp_path / "episodes.jsonl"
    rc = cli(["agent", "--config", "configs/agent_tiny.yaml", "--episodes", "2", "--out", str(out),
              f"workdir={tmp_path}", "agent.episodes=2", "agent.max_turns=2",
              "agent.max_action_tokens=16"])
    assert rc == 0
    metrics = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert float(metrics["agent/episodes"]) == 2 and float(metrics["agent/turns_mean"]) == 2
    assert float(metrics["agent/truncated"]) == 1.0  # a random model runs out of turns
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["info"]["turns"] == 2 for r in rows)


def test_agent_command_names_a_missing_task_dir(tmp_path, capsys):
    assert cli(["agent", "--config", "configs/agent_tiny.yaml", f"agent.tasks={tmp_path}"]) == 2
    assert "agent.tasks: no DIR/ID/task.json under" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["agent", "--episodes", "x"])


@pytest.mark.slow  # SFT on demonstrations, then two RL steps of episodes: 2.5 min at load ~1
def test_train_agent_tiny_runs_multi_turn_episodes(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device, as the CLI
    subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", "--config",
                    "configs/agent_tiny.yaml", "train.steps=2",
                    # tool outputs cut at 300 chars, not 600: the demonstrations' ~3.4k tokens
                    # shrink, and SFT (most of the run) with them
                    "agent.max_output_chars=300", f"workdir={tmp_path}"],
                   check=True, env=env, capture_output=True)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["sft/loss"] > 0 and "sft/tokens" in rows[0]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("agent/bad_tool_calls", "agent/truncated", "agent/test_edit_attempts",
                "agent/reward_mean", "agent/pass_rate", "rollout/reward_mean"):
        assert all(key in r for r in steps), key
    assert all(r["agent/turns_mean"] > 1 for r in steps)
    # The warm-up gets the tiny model to valid calls; per-tool counts add up to the total.
    assert all(r["agent/tool_calls"] > 0 for r in steps)
    for r in steps:
        assert sum(v for k, v in r.items() if k.startswith("agent/tool_calls/")) == r[
            "agent/tool_calls"]
    assert all(r["train/feedback_tokens"] > 0 for r in steps)  # bad calls get the feedback KL
    assert (tmp_path / "checkpoints" / "2").is_dir()
    logged = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    for r in logged:  # token-exact rows: the mask covers the sampled actions, which come first
        assert len(r["policy_mask"]) == len(r["completion"]) == len(r["logprobs"])
        assert r["policy_mask"][0]


@pytest.mark.slow  # ~4 min quiet, 8.5 min at load ~10: demos, 10 copy + 30 warm-up steps, 2 RL
def test_agent_default_shortened_end_to_end(tmp_path):
    """configs/agent_default.yaml, shortened: the warm-up gets the model making tool calls,
    RL steps play episodes (with their time split), held-out episodes are evaluated, and each
    phase shows progress lines."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device, as the CLI
    proc = subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", "--config",
                           "configs/agent_default.yaml", "agent.tasks=embedded:10",
                           "agent.eval_tasks=2", "sft.copy_steps=10", "sft.steps=30",
                           # the format first: 30 steps with a fact weight leave no valid
                           # call (the weight slows the format: docs/agent.md)
                           "sft.fact_weight=0", "sft.valid_tasks=3", "sft.valid_every=15",
                           "sft.valid_stop=0",
                           "train.steps=2",
                           "train.prompts_per_step=2", "agent.episodes=4", "train.micro_batch=4",
                           "rl.group_size=2", "eval.samples=1", "eval.k=[1]",
                           f"workdir={tmp_path}"],
                          check=True, env=env, capture_output=True, text=True)
    # progress lines for each long phase, though stderr is a pipe
    for phase in ("demos", "sft", "eval", "rl"):
        assert f"\n{phase} " in proc.stderr, phase
    rows = read_metrics(tmp_path / "metrics.jsonl")
    warm = next(r for r in rows if "sft/loss" in r)  # the copy rows' stage ran first
    assert 0 < warm["sft/copy_loss"] < 10 and 0 < warm["sft/loss"] < 10
    # the warm-up's own curves: each step's loss, the validation every 15 steps of the 30
    sft_rows = read_metrics(tmp_path / "warmup" / "metrics.jsonl")
    assert [r["step"] for r in sft_rows] == list(range(1, 41))
    assert all("sft/copy_loss" in r for r in sft_rows[:10])
    valid = [r for r in sft_rows if "sft/valid_exact/episode" in r]
    assert [r["step"] for r in valid] == [25, 40] and (tmp_path / "warmup" / "curves.png").exists()
    assert 0 <= valid[-1]["sft/valid_sampled/episode"] < 1  # a chance; no call is certain
    for key in ("episode", "run_tests", "read_file", "replace_line", "finish"):
        assert 0 <= valid[-1][f"sft/valid_exact/{key}"] <= 1
        assert warm[f"sft/valid_exact/{key}"] == valid[-1][f"sft/valid_exact/{key}"]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["agent/tool_calls"] > 0 and r["agent/turns_mean"] > 1
        assert 0 < r["time/tools_s"] < r["time/generate_s"]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval/agent/episodes"] == 2
                                                        for r in evals)
