"""The agent rollout producer: a versioned batch of task-major groups of token-exact episodes,
and the trainer's rows train exactly the policy's tokens; scripted demonstrations pass, and
stand in for a failed group's worst episode under guidance."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from jaxagent.rl.config import RLConfig
from jaxagent.tokenizer import ByteTokenizer
from jaxagent.train.build import expand_algorithm
from jaxagent.train.loop import compute_advantages, to_train_batch
from rollouts.agent import AgentConfig, ToolEnvironment
from rollouts.agent.demos import (
    EDIT_TOOLS,
    demonstrate,
    next_scripted_call,
    scripted_calls,
    turn_weights,
)
from rollouts.agent.feedback import action_spans
from rollouts.agent.formats import ToolCall, make_format
from rollouts.agent.producer import AgentRolloutProducer
from rollouts.environment import INFRA_ERROR
from rollouts.producer import Rollout
from rollouts.rewards import Scorer
from rollouts.sampler import Sampler
from rollouts.tasks.agent_family import agent_family_tasks
from rollouts.tasks.deletion import load_deletion_task
from rollouts.tools import TOOLS

TASKS = Path(__file__).resolve().parents[3] / "rollouts" / "tasks" / "data" / "textkit_tasks"
TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=48, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16)


def test_producer_batches_groups_and_train_rows_mask_only_policy_tokens():
    model = init_model(CFG, seed=0)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, nnx.state(model, nnx.Param)))
    sampler = Sampler(model, prompt_bucket=64, cache_bucket=1024, batch_bucket=2, segment_steps=24)
    # short prompts (three tools, one-line tasks) keep the CPU compile and attention cheap
    tasks = [dataclasses.replace(load_deletion_task(TASKS / name), prompt=f"Implement {name}.")
             for name in ("textkit-median", "textkit-wrap")]
    tools = [t for t in TOOLS if t.name in ("think", "run_tests", "finish")]
    options = AgentConfig(max_turns=2, max_context_tokens=8000, max_output_chars=200)
    with Scorer(workers=1) as scorer:
        envs = [ToolEnvironment(TOK, options, scorer=scorer, tools=tools) for _ in range(2)]
        producer = AgentRolloutProducer(sampler, TOK, itertools.cycle(tasks), envs,
                                        prompts_per_step=2, group_size=2, max_action_tokens=16,
                                        temperature=0.6, top_k=9, top_p=0.95, seed=0)
        batch = producer.produce(0, version=3)
        producer.close()
    assert batch.version == 3 and batch.group_size == 2 and len(batch.rollouts) == 4
    assert [r.task_id for r in batch.rollouts] == ["textkit-median"] * 2 + ["textkit-wrap"] * 2
    stats = batch.stats
    assert stats["agent/episodes"] == 4 and stats["agent/turns_mean"] == 2
    assert stats["agent/truncated"] == 1.0 and "rollout/reward_mean" in stats
    for r in batch.rollouts:  # a random policy runs out of turns: masked, out of the advantage
        assert r.masked and r.finish_reason == "max_turns" and r.version == 3
        mask = np.asarray(r.policy_mask)
        assert len(r.completion) == len(mask) == len(r.logprobs) and mask[0] and not mask.all()
        assert np.all(np.asarray(r.logprobs)[~mask] == 0.0)
    assert not batch.valid().any()
    _, keep = compute_advantages(expand_algorithm(RLConfig(group_size=2)), batch, 16)
    assert not keep.any()

    # With every row kept, the loss mask is the policy mask, shifted onto the targets.
    keep = np.ones(4, bool)
    plain = to_train_batch(batch, np.ones(4), keep)
    shared = to_train_batch(batch, np.ones(4), keep, share_prompt=True)
    for i, r in enumerate(batch.rollouts):
        lp, lc = len(r.prompt), len(r.completion)
        want = np.asarray(([0.0] * lp + [float(m) for m in r.policy_mask])[1:])
        np.testing.assert_array_equal(np.asarray(plain.loss_mask[i, :lp + lc - 1]), want)
        assert not np.asarray(plain.loss_mask[i, lp + lc - 1:]).any()
        np.testing.assert_array_equal(np.asarray(plain.targets[i, :lp + lc - 1]),
                                      (r.prompt + r.completion)[1:])
        np.testing.assert_array_equal(np.asarray(shared.loss_mask[i, :lc]), r.policy_mask)
        np.testing.assert_array_equal(np.asarray(shared.targets[i, :lc]), r.completion)
        np.testing.assert_array_equal(np.asarray(shared.sampler_logprobs[i, :lc]),
                                      np.asarray(r.logprobs, np.float32))
    # On-policy, the trainer's log-probs of every action token under the sampling distribution
    # (T = 0.6, top-k, top-p) are the sampler's: each ratio is 1.
    from jaxagent.steps import target_logprobs

    on = np.asarray(plain.loss_mask) > 0
    logp = np.asarray(target_logprobs(model, plain, 0, (0.6, 9, 0.95))[0])
    np.testing.assert_allclose(np.exp(logp[on] - np.asarray(plain.sampler_logprobs)[on]), 1.0,
                               atol=2e-4)


@pytest.mark.parametrize("name", sorted(p.name for p in TASKS.iterdir()))
def test_scripted_demonstration_solves_each_task_through_the_environment(name):
    task = load_deletion_task(TASKS / name)
    calls = scripted_calls(task)
    edits = 2 if name == "textkit-to_roman+from_roman" else 1  # one per deleted body
    assert [c.name for c in calls] == ["run_tests", "read_file", *["edit"] * edits, "run_tests",
                                       "finish"]
    with Scorer(workers=1) as scorer:
        env = ToolEnvironment(TOK, AgentConfig(max_turns=6, max_context_tokens=20000),
                              scorer=scorer)
        traj = demonstrate(env, task, calls)
        env.close()
    assert traj.done and traj.reward == 1.0 and traj.info["passed"]
    assert traj.info["turns"] == len(calls) and traj.info["bad_tool_calls"] == 0
    # The policy's runs are exactly the rendered calls, each with the stop token; the rest is
    # the prompt and the tool outputs (none after finish).
    actions = [TOK.encode(env.format.render_call(c)) + [TOK.stop_ids[0]] for c in calls]
    spans = action_spans(traj.policy_mask)
    assert [traj.tokens[a:b] for a, b in spans] == actions
    assert spans[0][0] == traj.prompt_len and spans[-1][1] == len(traj.tokens)


def test_turn_weights_give_every_turn_weight_one():
    mask = [False, True, True, True, False, False, True, False, True, True]
    w = turn_weights(mask)
    np.testing.assert_allclose(w, [0, 1 / 3, 1 / 3, 1 / 3, 0, 0, 1, 0, 0.5, 0.5])
    assert turn_weights([]) == [] and sum(turn_weights([True] * 7)) == pytest.approx(1.0)


FAMILY_TOOLS = [t for t in TOOLS if t.name in ("read_file", "replace_line", "run_tests", "finish")]


def _curriculum_producer(sampler, envs, tasks, fraction, seed=0, group_size=2, **kwargs):
    return AgentRolloutProducer(sampler, TOK, iter(tasks), envs, prompts_per_step=len(tasks),
                                group_size=group_size, max_action_tokens=8, temperature=1.0,
                                seed=seed, scripted_prefix=fraction, edit_tool="replace_line",
                                **kwargs)


def test_scripted_prefixes_are_drawn_per_group_from_seed_and_index():
    tasks = agent_family_tasks(40, seed=1, names="fixed")
    env = ToolEnvironment(TOK, AgentConfig(), tools=FAMILY_TOOLS)  # no session until reset
    half = _curriculum_producer(None, [env], tasks, 0.5)
    draws = half.start_prefixes(3, tasks)
    assert draws == half.start_prefixes(3, tasks)  # a resumed run replays batch 3's
    assert draws != half.start_prefixes(4, tasks)
    assert draws != _curriculum_producer(None, [env], tasks, 0.5, seed=1).start_prefixes(3, tasks)
    scripts = [scripted_calls(task, "replace_line") for task in tasks]
    lengths = set()
    for index in range(4):
        for script, prefix in zip(scripts, half.start_prefixes(index, tasks), strict=True):
            before_edit = next(i for i, c in enumerate(script) if c.name in EDIT_TOOLS)
            assert prefix == script[:len(prefix)] and len(prefix) <= before_edit
            lengths.add(len(prefix))
    assert lengths == {0, 1, 2, 3}  # none, and every k up to the last read of two-read tasks
    assert _curriculum_producer(None, [env], tasks, 0.0).start_prefixes(3, tasks) == [[]] * 40
    assert all(_curriculum_producer(None, [env], tasks, 1.0).start_prefixes(3, tasks))
    unscripted = [dataclasses.replace(tasks[0], metadata={})]
    with pytest.raises(ValueError, match="agent.scripted_prefix needs scripted tasks"):
        _curriculum_producer(None, [env], unscripted, 1.0).start_prefixes(0, unscripted)


@pytest.mark.slow  # 6-20 s on the 2-core VM: the sampler compiles for 1k-token prompts
def test_prefixed_groups_sample_after_the_scripted_calls_and_train_only_the_sampled_tokens():
    model = init_model(CFG, seed=0)
    sampler = Sampler(model, prompt_bucket=512, cache_bucket=2048, batch_bucket=2, segment_steps=8)
    tasks = agent_family_tasks(2, seed=1, templates=["constant"], names="fixed")
    # one sampled turn after the prefix: max_turns counts the scripted calls
    options = AgentConfig(max_turns=3, max_context_tokens=4096, max_output_chars=200)
    with Scorer(workers=1) as scorer:
        envs = [ToolEnvironment(TOK, options, scorer=scorer, tools=FAMILY_TOOLS) for _ in range(2)]
        # every sampled turn a bad call or not, the scripted teacher's call for it
        producer = _curriculum_producer(sampler, envs, tasks, 1.0,
                                        feedback_detectors=["bad_tool_call"],
                                        feedback_teacher="script")
        prefixes = producer.start_prefixes(0, tasks)
        batch = producer.produce(0, version=1)
        starts = [demonstrate(envs[0], task, prefix).tokens
                  for task, prefix in zip(tasks, prefixes, strict=True)]
        producer.close()
    assert all(1 <= len(p) <= 2 for p in prefixes)  # run_tests, read_file: then the edit
    for i, r in enumerate(batch.rollouts):
        assert r.prompt == starts[i // 2]  # token for token the scripted start
        mask = np.asarray(r.policy_mask)
        assert mask[0] and np.all(np.asarray(r.logprobs)[mask] < 0.0)
        assert r.finish_reason == "max_turns"
        # a flagged turn (the prefix's calls ran, no sampled call before it) gets the script's
        # call after the prefix
        script = scripted_calls(tasks[i // 2], "replace_line")
        want = TOK.encode(make_format("compact").render_call(
            next_scripted_call(script, prefixes[i // 2]))) + list(TOK.stop_ids[:1])
        assert r.corrections == [want] * len(r.flagged)
    assert any(r.flagged for r in batch.rollouts)  # a random policy's calls are malformed
    stats = batch.stats
    assert stats["agent/prefix_fraction"] == 1.0
    assert stats["agent/prefix_calls_mean"] == sum(map(len, prefixes)) / 2
    assert stats["agent/turns_mean"] == 3.0 and "agent/pass_rate_from_prefix" in stats
    assert "agent/pass_rate_from_start" not in stats
    train = to_train_batch(batch, np.ones(4), np.ones(4, bool))
    for i, r in enumerate(batch.rollouts):  # the loss covers the sampled action, not the prefix
        lp = len(r.prompt)
        assert not np.asarray(train.loss_mask[i, :lp - 1]).any()
        assert np.asarray(train.loss_mask[i, lp - 1]) > 0


def test_guidance_puts_the_scripted_demonstration_in_place_of_a_failed_group_s_worst():
    tasks = agent_family_tasks(40, seed=1, templates=["constant_keyed"], names="fixed")[:4]

    def failed(task, reward, status="failed"):
        return Rollout(task.id, [1, 2], [3, 4], [True, True], [-1.0, -2.0], "", reward, status,
                       "stop", 5)

    def played(producer, index):
        rollouts = [failed(tasks[0], 0.3), failed(tasks[0], 0.0),  # none passed: guided
                    failed(tasks[1], 0.0), failed(tasks[1], 1.0, "passed"),  # one passed
                    failed(tasks[2], 0.0), failed(tasks[2], 0.0, INFRA_ERROR),  # unknown
                    failed(tasks[3], 0.0), failed(tasks[3], 0.0)]  # the later of equals
        return producer.guide(index, tasks, rollouts, version=5), rollouts

    options = AgentConfig(max_turns=8, max_context_tokens=20000, max_output_chars=600)
    with Scorer(workers=1) as scorer:
        envs = [ToolEnvironment(TOK, options, scorer=scorer, tools=FAMILY_TOOLS)
                for _ in range(2)]
        every = _curriculum_producer(None, envs, tasks, 0.0, group_size=2, guidance=1.0)
        guided, rollouts = played(every, 0)
        demos = [demonstrate(envs[0], t, scripted_calls(t, "replace_line")) for t in tasks]
        half = _curriculum_producer(None, envs, tasks, 0.0, group_size=2, guidance=0.5,
                                    seed=3)
        draws = [[r.guided for r in played(half, index)[1]] for index in range(8)]
        for env in envs:
            env.close()
    assert guided == 2 and [r.guided for r in rollouts] == [False, True] + [False] * 5 + [True]
    for i, demo in ((1, demos[0]), (7, demos[3])):
        r = rollouts[i]
        assert r.prompt + r.completion == demo.tokens and r.reward == 1.0 == demo.reward
        assert r.policy_mask == demo.policy_mask[demo.prompt_len:] and r.version == 5
    assert rollouts[0] == failed(tasks[0], 0.3) and rollouts[5].status == INFRA_ERROR
    assert set(every.demos) == {tasks[0].id, tasks[3].id}  # played once, then reused
    prefixed = [failed(tasks[0], 0.0)] * 2  # another start state than the demonstration's
    assert every.guide(0, tasks[:1], prefixed, 5, [[ToolCall("run_tests", {})]]) == 0
    assert not any(r.guided for r in prefixed)
    assert draws == [[r.guided for r in played(half, index)[1]] for index in range(8)]
    assert {tuple(d) for d in draws} > {(False,) * 8}  # some batches guided, others not
