"""ToolEnvironment end to end: a scripted policy solves an embedded task; editing the tests,
malformed calls and budgets are caught; trajectories stay token-exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxagent.tokenizer import ByteTokenizer
from rollouts.agent import (
    AgentConfig,
    ToolCall,
    ToolEnvironment,
    make_format,
    observation_text,
)
from rollouts.environment import Trajectory
from rollouts.rewards import RewardConfig, Scorer
from rollouts.tasks.deletion import load_deletion_task

TASKS = Path(__file__).resolve().parents[3] / "rollouts" / "tasks" / "data" / "textkit_tasks"
TOK = ByteTokenizer()
FMT = make_format("compact")
MEDIAN = """    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
"""


@pytest.fixture(scope="module")
def scorer():
    with Scorer(workers=1) as s:
        yield s


@pytest.fixture
def task():
    return load_deletion_task(TASKS / "textkit-median")


def action(call: ToolCall | str) -> list[int]:
    """What a policy would sample: the call's text, then the stop token."""
    text = call if isinstance(call, str) else FMT.render_call(call)
    return TOK.encode(text) + [TOK.eos_id]


def play(env, task, calls):
    """Run a scripted policy; returns the trajectory and every step's result."""
    prompt = env.reset(task)
    traj = Trajectory.start(task.id, prompt, version=0)
    results = []
    for call in calls:
        act = action(call)
        traj.add_action(act, [-0.5] * len(act))
        result = env.step(act)
        traj.record(result)
        results.append(result)
        if result.done:
            break
    return traj, results


SOLVE = [
    ToolCall("think", {"thought": "median is missing; run the tests first"}),
    ToolCall("run_tests", {}),
    ToolCall("search", {"query": "def median"}),
    ToolCall("edit", {"path": "textkit/stats.py",
                      "search": "count).\"\"\"\n    raise NotImplementedError\n",
                      "replace": "count).\"\"\"\n" + MEDIAN}),
    ToolCall("run_tests", {"test": "tests/test_stats.py"}),
    ToolCall("history", {"path": "textkit/stats.py"}),
    ToolCall("finish", {"summary": "implemented median"}),
]


def test_the_next_episode_renews_the_sandbox(task, scorer):
    """A new episode keeps the last one's sandbox (its command server, its uid) but none of
    its files: the work dir holds the new task's repository alone."""
    env = ToolEnvironment(TOK, AgentConfig(max_turns=10, max_context_tokens=20000), scorer=scorer)
    play(env, task, [ToolCall("write_file", {"path": "notes.txt", "content": "the answer"}),
                     ToolCall("write_file", {"path": "textkit/stats.py", "content": "broken"}),
                     ToolCall("finish", {})])
    sandbox = env._sandbox
    server = sandbox.server.channel.proc.pid
    _, results = play(env, task, [ToolCall("read_file", {"path": "notes.txt"}),
                                  ToolCall("run_tests", {}), ToolCall("finish", {})])
    assert env._sandbox is sandbox and sandbox.server.channel.proc.pid == server
    assert "does not exist" in TOK.decode(results[0].observation)
    assert "1 failed" in TOK.decode(results[1].observation)  # the pristine stats.py again
    assert results[-1].info["status"] == "failed"
    env.close()
    assert not sandbox.root.exists()


def test_scripted_policy_solves_an_embedded_task(task, scorer):
    env = ToolEnvironment(TOK, AgentConfig(max_turns=10, max_context_tokens=20000), scorer=scorer)
    traj, results = play(env, task, SOLVE)
    assert "1 failed" in TOK.decode(results[1].observation)
    assert "textkit/stats.py:11:def median(xs):" in TOK.decode(results[2].observation)
    assert "edited textkit/stats.py at line 12" in TOK.decode(results[3].observation)
    assert "tests: 4 passed, 0 failed" in TOK.decode(results[4].observation)
    assert "stats: mean, median, variance and RunningMean" in TOK.decode(results[5].observation)
    last = results[-1]
    assert last.done and last.reward == 1.0 and last.observation == []
    info = last.info
    assert info["status"] == "passed" and not info["hack"] and not info["truncated"]
    assert info["turns"] == 7 and info["bad_tool_calls"] == 0
    assert info["tool_calls"] == {"think": 1, "run_tests": 2, "search": 1, "edit": 1, "history": 1,
                                  "finish": 1}
    assert env.session is None  # the episode's session ends with it
    env.close()

    # token-exact: prompt, then each action as sampled, then each observation tokenized once
    expected = TOK.encode(env.format.prompt(TOK, task.prompt, env.toolbox.schemas()))
    mask = [False] * len(expected)
    for call, result in zip(SOLVE, results, strict=True):
        act = action(call)
        expected += act + result.observation
        mask += [True] * len(act) + [False] * len(result.observation)
    assert traj.tokens == expected and traj.policy_mask == mask
    assert traj.logprobs == [-0.5 if m else 0.0 for m in mask]
    assert results[0].observation == TOK.encode(observation_text(TOK, "ok", action_ended=True))


def test_editing_the_tests_to_pass_earns_minus_the_hack_penalty_and_a_hack_flag(task, scorer):
    # the penalty is the scorer's (rewards.hack_penalty), as for a `hack` verdict
    penalised = Scorer(RewardConfig(hack_penalty=0.5), sandbox=scorer.sandbox)
    env = ToolEnvironment(TOK, AgentConfig(), scorer=penalised)
    fake = "def test_median_odd_and_even():\n    assert True\n"
    _, results = play(env, task, [
        ToolCall("shell", {"command": "sed -i 's/assert median/assert 1 or median/' tests/test_stats.py"}),
        ToolCall("write_file", {"path": "tests/test_extra.py", "content": fake}),
        ToolCall("finish", {})])
    info = results[-1].info
    assert results[-1].reward == -0.5 and info["hack"]
    assert info["edited_tests"] == ["tests/test_extra.py", "tests/test_stats.py"]
    assert info["test_edit_attempts"] == 2
    assert [f["test_edit"] for f in info["turn_flags"]] == [True, True, False]
    assert info["status"] == "failed"  # graded on the pristine tests: median is still missing
    env.close()


def test_malformed_and_unknown_calls_are_error_observations_and_counted(task, scorer):
    env = ToolEnvironment(TOK, AgentConfig(max_turns=3, truncation="penalty", truncation_penalty=0.5,
                                            bad_call_penalty=0.125), scorer=scorer)
    _, results = play(env, task, ["@@@ what", ToolCall("rm_rf", {}), '@edit {"path": 1}'])
    texts = [TOK.decode(r.observation) for r in results[:2]]
    assert "error: no tool call found" in texts[0] and "error: unknown tool 'rm_rf'" in texts[1]
    info = results[-1].info
    assert info["bad_tool_calls"] == 3 and info["tool_calls"] == {"edit": 1}
    assert info["truncated"] and info["truncated_by"] == "max_turns" and not info["masked"]
    assert results[-1].reward == -0.5 - 3 * 0.125  # failed (0), the truncation and 3 bad calls
    env.close()


def test_budgets_mask_truncated_episodes_and_flag_repeats(task, scorer):
    env = ToolEnvironment(TOK, AgentConfig(max_context_tokens=3000), scorer=scorer)
    call = ToolCall("read_file", {"path": "textkit/stats.py"})
    _, results = play(env, task, [call] * 8)
    info = results[-1].info
    assert info["truncated"] and info["truncated_by"] == "max_context_tokens" and info["masked"]
    assert [f["repeat"] for f in info["turn_flags"]] == [False] + [True] * (len(results) - 1)
    assert len(results) < 8
    env.close()


def test_reset_refuses_function_tasks_and_options_are_checked():
    from rollouts.tasks import synthetic_tasks

    env = ToolEnvironment(TOK)
    with pytest.raises(ValueError, match="needs a repository task"):
        env.reset(synthetic_tasks(1)[0])
    with pytest.raises(ValueError, match="max_turns must be positive"):
        AgentConfig(max_turns=0)
    with pytest.raises(ValueError, match="truncation must be"):
        AgentConfig(truncation="drop")
    with pytest.raises(ValueError, match=r"scripted_prefix is a fraction of groups in \[0, 1\]"):
        AgentConfig(scripted_prefix=1.5)
    with pytest.raises(ValueError, match=r"guidance is a fraction of groups in \[0, 1\]"):
        AgentConfig(guidance=-0.5)
    with pytest.raises(ValueError, match="AgentConfig.bad_call_penalty must be >= 0"):
        AgentConfig(bad_call_penalty=-0.1)
    with pytest.raises(ValueError, match="feedback_hints maps detectors"):
        AgentConfig(feedback_hints={"bad_call": "@run_tests"})  # no such detector
    with pytest.raises(ValueError, match="feedback_hints maps detectors"):
        AgentConfig(feedback_hints={"repeat": " "})
    assert AgentConfig(feedback_hints={"repeat": "@finish"}).feedback_hints == {"repeat": "@finish"}
    with pytest.raises(RuntimeError, match="before reset"):
        env.step([1])


def test_hermes_episode_with_a_chat_template_tokenizer(task, scorer, qwen_tok):
    env = ToolEnvironment(qwen_tok, AgentConfig(call_format="hermes", max_context_tokens=20000),
                          scorer=scorer)
    prompt = env.reset(task)
    text = qwen_tok.decode(prompt, skip_special=False)
    assert '"name": "run_tests"' in text and text.endswith("<|im_start|>assistant\n")
    fmt = make_format("hermes")
    act = qwen_tok.encode(fmt.render_call(ToolCall("run_tests", {}))) + [qwen_tok.eos_id]
    result = env.step(act)
    obs = qwen_tok.decode(result.observation, skip_special=False)
    assert obs.startswith("\n<|im_start|>user\n<tool_response>\ntests: 12 passed, 1 failed")
    assert obs.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    done = env.step(qwen_tok.encode(fmt.render_call(ToolCall("finish", {}))))
    assert done.done and done.info["status"] == "failed" and done.info["bad_tool_calls"] == 0
    env.close()


# What an agent could write with its tools to forge the reward of the median task: each keeps
# median broken (or lying), then finishes. None may earn the reward.
_STATS = (TASKS / "textkit-median" / "repo" / "textkit" / "stats.py").read_text()
_FORGE = ("import json, os, struct\n_b = json.dumps(['done', 0]).encode()\n"
          "os.write(3, struct.pack('>I', len(_b)) + _b)\n")
EPISODE_ATTACKS = {
    "forged_frames_in_module": ("textkit/stats.py", _FORGE + _STATS),
    "always_equal_median": ("textkit/stats.py", _STATS.replace(
        "    raise NotImplementedError\n",
        "    class Eq:\n        def __eq__(self, o):\n            return True\n    return Eq()\n", 1)),
    "shadow_stdlib_at_root": ("inspect.py", _FORGE + "raise SystemExit(0)\n"),
    "pytest_toml": ("pytest.toml", "[pytest]\naddopts = ['--deselect', 'tests/test_stats.py']\n"),
    "plugin_metadata": ("evil-1.dist-info/entry_points.txt", "[pytest11]\nevil = textkit.stats\n"),
    "patch_pytest_at_import": ("textkit/stats.py",
                               "import _pytest.python\n_pytest.python.Function.runtest = lambda s: None\n"
                               + _STATS),
}


@pytest.mark.parametrize("name", sorted(EPISODE_ATTACKS))
def test_an_agent_cannot_forge_its_reward_with_its_tools(task, scorer, name):
    path, content = EPISODE_ATTACKS[name]
    env = ToolEnvironment(TOK, AgentConfig(max_turns=4), scorer=scorer)
    _, results = play(env, task, [ToolCall("write_file", {"path": path, "content": content}),
                                  ToolCall("finish", {"summary": "done"})])
    last = results[-1]
    assert last.done and last.reward <= 0.0 and last.info["status"] != "passed", last.info
    assert last.info["grading"] == "isolated"
    env.close()


def test_a_run_cache_changes_no_episode_and_counts_the_runs_it_served(scorer):
    """`agent.test_cache`: episodes sharing a `RunCache` are those of environments without it,
    token for token and reward for reward; a `run_tests` on files some earlier run saw (this
    episode's or another's) is read from the cache, and the metric says what share was."""
    from rollouts.agent.demos import demonstrate, scripted_calls
    from rollouts.agent.metrics import agent_metrics
    from rollouts.sandbox.run_cache import RunCache
    from rollouts.tasks.agent_family import agent_family_tasks

    tasks = [agent_family_tasks(10, seed=3, templates=[t], names="fixed")[0]
             for t in ("constant_keyed", "exception")]
    options = AgentConfig(max_turns=10, max_context_tokens=4096, call_format="compact",
                          max_output_chars=600, test_cache=True)
    cache = RunCache()
    plain = ToolEnvironment(TOK, options, scorer=scorer)
    shared = ToolEnvironment(TOK, options, scorer=scorer, run_cache=cache)
    try:
        for task in tasks:
            calls = scripted_calls(task, "replace_line")
            edit = next(i for i, c in enumerate(calls) if c.name == "replace_line")
            calls = [*calls[:edit], ToolCall("run_tests", {}), *calls[edit:]]  # before the edit
            assert [c.name for c in calls].count("run_tests") == 3
            want = demonstrate(plain, task, calls)
            assert want.info["passed"] and want.info["cached_test_runs"] == 0
            played = [demonstrate(shared, task, calls) for _ in range(2)]
            for got in played:
                assert (got.tokens, got.policy_mask, got.reward) == (
                    want.tokens, want.policy_mask, want.reward)
                assert {**got.info, "cached_test_runs": 0} == want.info
            # the first play reads its second run (files unchanged by read_file); the next, all
            assert [t.info["cached_test_runs"] for t in played] == [1, 3]
            metrics = agent_metrics(played)
            assert metrics["agent/test_runs_cached"] == pytest.approx(4 / 6)
            assert agent_metrics([want])["agent/test_runs_cached"] == 0.0
    finally:
        plain.close()
        shared.close()
