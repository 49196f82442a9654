"""Scripted episodes over the embedded agent family: a policy that reads the missing fact from
the tools (the failing test output, a search) solves the task; the same edit made blindly
from the prompt alone fails."""

from __future__ import annotations

import json
import re

import pytest

from jaxagent.tokenizer import ByteTokenizer
from rollouts.agent import AgentConfig, ToolCall, ToolEnvironment, make_format
from rollouts.agent.metrics import agent_metrics, ran_tests_before_finish
from rollouts.environment import Trajectory
from rollouts.rewards import Scorer
from rollouts.tasks.agent_family import agent_family_tasks

TOK = ByteTokenizer()
FMT = make_format("compact")


@pytest.fixture(scope="module")
def scorer():
    with Scorer(workers=1) as s:
        yield s


def first(template: str, seed: int = 0):
    return next(t for t in agent_family_tasks(10, seed) if t.metadata["family"] == template)


class Episode:
    """Plays one call at a time, so a scripted policy can look at each observation."""

    def __init__(self, env, task):
        self.env, self.traj = env, Trajectory.start(task.id, env.reset(task), version=0)
        self.result = None

    def __call__(self, name: str, **args) -> str:
        act = TOK.encode(FMT.render_call(ToolCall(name, args))) + [TOK.eos_id]
        self.traj.add_action(act, [0.0] * len(act))
        self.result = self.env.step(act)
        self.traj.record(self.result)
        return TOK.decode(self.result.observation)


def test_the_fact_in_the_failing_test_output_solves_a_constant_task(scorer):
    task = first("constant")
    path = next(p for p in task.files if p.endswith(".py") and not p.startswith("tests")
                and task.files[p])
    const = re.search(r"but (\w+) has the wrong value", task.prompt).group(1)
    assert re.search(rf"{const} = \d+", task.prompt) is None  # the prompt lacks the value
    env = ToolEnvironment(TOK, AgentConfig(max_turns=6, max_context_tokens=4000), scorer=scorer)
    play = Episode(env, task)
    failing = play("run_tests")
    got, want = re.search(r"E       assert (\d+) == (\d+)", failing).groups()  # the fact
    source = play("read_file", path=path)
    assert f"{const} = {got}" in source
    assert "edited" in play("edit", path=path, search=f"{const} = {got}", replace=f"{const} = {want}")
    assert "1 passed, 0 failed" in play("run_tests")
    play("finish")
    r = play.result
    assert r.done and r.reward == 1.0 and r.info["status"] == "passed"
    assert r.info["call_order"] == ["run_tests", "read_file", "edit", "run_tests", "finish"]
    assert ran_tests_before_finish(r.info)
    metrics = agent_metrics([play.traj])
    assert metrics["agent/solved_tested_first"] == 1.0 and metrics["agent/pass_rate"] == 1.0
    env.close()


def test_a_helper_found_by_search_solves_a_helper_task(scorer):
    task = first("helper")
    env = ToolEnvironment(TOK, AgentConfig(max_turns=6, max_context_tokens=4000), scorer=scorer)
    play = Episode(env, task)
    hits = play("search", query="canonical key of a name")
    where = re.search(r"\./(\S+\.py):\d+:", hits).group(1)
    helper_src = play("read_file", path=where)
    helper = re.findall(r"def (\w+)\(s\):", helper_src)[-1]  # the one documented as the key maker
    target = next(p for p in task.files if p.endswith(".py") and "def " in task.files[p]
                  and p != where and not p.startswith("tests"))
    module = where.removesuffix(".py").replace("/", ".")
    play("edit", path=target, search="[n for n in names]", replace=f"[{helper}(n) for n in names]")
    play("edit", path=target, search='package."""\n', replace=f'package."""\n\nfrom {module} import {helper}\n')
    assert "1 passed, 0 failed" in play("run_tests")
    play("finish")
    assert play.result.reward == 1.0 and play.result.info["tool_calls"]["search"] == 1
    env.close()


@pytest.mark.parametrize("template", ["exception", "hidden_file", "edge_case"])
def test_a_blind_edit_from_the_prompt_alone_fails(scorer, template):
    """The prompt does not say which error (or separator): the guess an agent makes without
    running the tests is wrong, and the episode earns nothing."""
    task = first(template)
    env = ToolEnvironment(TOK, AgentConfig(max_turns=4), scorer=scorer)
    play = Episode(env, task)
    for path, content in json.loads(task.metadata["blind"]).items():
        play("write_file", path=path, content=content)
    play("finish")
    r = play.result
    assert r.done and r.reward == 0.0 and r.info["status"] == "failed"
    assert not ran_tests_before_finish(r.info)
    env.close()
