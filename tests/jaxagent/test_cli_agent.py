"""`jaxagent agent`: tool episodes of the tiny model on CPU end to end; the agent configs load."""

from __future__ import annotations

import json

import pytest

from jaxagent.cli import main as cli
from jaxagent.config import load_config
from rollouts.agent import AgentOptions


def test_agent_configs_load_and_map_onto_agent_options():
    tiny = load_config("configs/agent_tiny.yaml")
    assert tiny.agent.enabled and tiny.agent.call_format == "compact"
    options = AgentOptions.from_config(tiny.agent, hack_penalty=tiny.rewards.hack_penalty)
    assert options.max_turns == tiny.agent.max_turns == 4
    big = load_config("configs/agent_qwen2.5-coder-7b.yaml")
    assert big.agent.call_format == "hermes" and big.init_from.startswith("/checkpoints/")
    AgentOptions.from_config(big.agent)


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
