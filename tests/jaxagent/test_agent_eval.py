"""`jaxagent eval` on an agent config: the tiny random model plays held-out episodes of the
embedded agent family with the real sampler and tools; pass@k and the agent metrics come back."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from jaxagent.cli import main as cli
from jaxagent.config import load_config
from jaxagent.errors import UserError
from jaxagent.eval import pass_at_k
from jaxagent.train.build import load_agent_splits
from jaxagent.train.evaluate import run_eval

# Short budgets: two held-out tasks, two episodes each, two turns of eight tokens.
FAST = ["agent.tasks=embedded:16:3", "agent.eval_tasks=2", "agent.episodes=4",
        "agent.max_turns=2", "agent.max_action_tokens=8", "eval.samples=2"]


def test_embedded_agent_tasks_split_into_train_and_held_out():
    cfg = load_config("configs/agent_tiny.yaml", FAST)
    train, held = load_agent_splits(cfg)
    assert len(held) == 2 and 8 <= len(train) < 16
    assert {t.metadata["split_key"] for t in train}.isdisjoint(t.metadata["split_key"] for t in held)
    assert all(t.repo is not None for t in train + held)
    textkit = load_config("configs/agent_tiny.yaml")
    assert load_agent_splits(textkit)[1] == []  # deletion tasks: all for training


def test_agent_eval_plays_held_out_episodes_and_reports_pass_at_k(tmp_path, capsys):
    out = tmp_path / "episodes.jsonl"
    rc = cli(["eval", "--config", "configs/agent_tiny.yaml", "--k", "1,2", "--out", str(out),
              f"workdir={tmp_path}", *FAST])
    assert rc == 0
    captured = capsys.readouterr()
    scores = {k: float(v) for k, v in (line.split(": ") for line in captured.out.splitlines())}
    assert "eval 4/4" in captured.err  # progress lines, stderr being no terminal here
    for key in ("eval/pass@1", "eval/pass@2", "eval/agent/episodes", "eval/agent/turns_mean",
                "eval/agent/tool_calls", "eval/agent/bad_tool_calls", "eval/agent/truncated",
                "eval/agent/test_edit_attempts", "eval/agent/solved_tested_first"):
        assert key in scores, key
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    family = {t.id: t.metadata["family"]
              for t in load_agent_splits(load_config("configs/agent_tiny.yaml", FAST))[1]}
    assert len(rows) == 4 and {r["task_id"] for r in rows} == set(family)  # 2 episodes of each
    by_family = defaultdict(list)  # the pass rate of each template drawn
    for r in rows:
        by_family[family[r["task_id"]]].append(r["solved"])
    assert {k: v for k, v in scores.items() if k.startswith("eval/agent/pass_rate/")} == {
        f"eval/agent/pass_rate/{f}": pytest.approx(sum(v) / len(v)) for f, v in by_family.items()}
    assert scores["eval/agent/episodes"] == 4
    # every episode ends by finishing or at the turn limit, and the metrics say which
    assert all(1 <= r["turns"] <= 2 for r in rows)
    assert scores["eval/agent/truncated"] == sum(bool(r["truncated"]) for r in rows) / 4
    assert scores["eval/agent/turns_mean"] == sum(r["turns"] for r in rows) / 4
    # pass@k: the unbiased estimator over each task's two episodes, averaged over tasks
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task_id"]].append(r["solved"])
    for k in (1, 2):
        want = sum(pass_at_k(2, sum(v), k) for v in by_task.values()) / len(by_task)
        assert scores[f"eval/pass@{k}"] == pytest.approx(want)


def test_agent_eval_needs_held_out_tasks(tmp_path):
    cfg = load_config("configs/agent_tiny.yaml", [f"workdir={tmp_path}"])
    with pytest.raises(UserError, match="no held-out split"):
        run_eval(cfg)


@pytest.mark.slow  # one RL step of episodes plus two evaluations: ~1 min on a quiet 2-core VM
def test_agent_training_run_evaluates_held_out_episodes(tmp_path):
    import os
    import subprocess
    import sys

    from jaxagent.metrics import read_metrics

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device, as the CLI
    subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", "--config",
                    "configs/agent_tiny.yaml", "train.steps=1", "sft.steps=0",
                    "agent.feedback_beta=0", f"workdir={tmp_path}", *FAST],
                   check=True, env=env, capture_output=True)
    evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1]  # before RL and at the end
    assert all(r["eval/agent/episodes"] == 4 and "eval/agent/solved_tested_first" in r
               for r in evals)
    # `jaxagent eval` of the run: its own config, with the command line's overrides on top
    scores, rows = run_eval(load_config(None), checkpoint=str(tmp_path),
                            overrides=["eval.samples=1"])
    assert scores["eval/agent/episodes"] == 2 and len(rows) == 2


def test_agent_tools_selects_the_offered_tools():
    from jaxagent.config import ConfigError
    from jaxagent.tokenizer import ByteTokenizer
    from jaxagent.train.build import tool_env_factory, validate

    cfg = load_config("configs/agent_tiny.yaml", [*FAST, "agent.tools=[run_tests,read_file,edit,finish]"])
    task = load_agent_splits(cfg)[1][0]
    few = tool_env_factory(cfg, ByteTokenizer(), scorer=None)()
    every = tool_env_factory(load_config("configs/agent_tiny.yaml", FAST), ByteTokenizer(),
                             scorer=None)()
    assert sorted(few.toolbox.tools) == ["edit", "finish", "read_file", "run_tests"]
    assert len(few.reset(task)) < len(every.reset(task)) - 100  # seven signatures fewer
    few.close()
    every.close()
    for bad, why in (("[run_tests,nope,finish]", "unknown tools"), ("[run_tests]", "must include finish")):
        with pytest.raises(ConfigError, match=why):
            validate(load_config("configs/agent_tiny.yaml", [f"agent.tools={bad}"]))
