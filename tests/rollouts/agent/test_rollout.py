"""Concurrent tool episodes driven by the sampler: trajectories hold exactly the sampled tokens,
the mask covers exactly them, and slots are refilled until every task has run."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from jaxagent.tokenizer import ByteTokenizer
from rollouts.agent import AgentConfig, ToolEnvironment
from rollouts.agent.rollout import run_episodes
from rollouts.rewards import Scorer
from rollouts.sampler import Continuation, Sampler
from rollouts.tasks.deletion import load_deletion_task
from rollouts.tools import TOOLS

TASKS = Path(__file__).resolve().parents[3] / "rollouts" / "tasks" / "data" / "textkit_tasks"
TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=48, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16)


class Recording(Continuation):
    """Keeps every action exactly as `turn` returned it, to compare with the trajectories."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled: dict[int, list] = {}

    def turn(self):
        out = super().turn()
        for slot, (tokens, logprobs, _) in out.items():
            self.sampled.setdefault(slot, []).append((list(tokens), np.asarray(logprobs)))
        return out


def test_concurrent_episodes_are_token_exact_and_slots_refill():
    model = init_model(CFG, seed=0)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, nnx.state(model, nnx.Param)))
    sampler = Sampler(model, prompt_bucket=64, cache_bucket=1024, batch_bucket=2, segment_steps=24)
    cont = Recording(sampler, slots=2, max_new_tokens=24, stop_token_ids=TOK.stop_ids, seed=3)
    # short prompts (three tools, one-line tasks) keep the CPU compile and attention cheap
    tasks = [dataclasses.replace(load_deletion_task(TASKS / name), prompt=f"Implement {name}.")
             for name in ("textkit-median", "textkit-wrap", "textkit-slugify")]
    tools = [t for t in TOOLS if t.name in ("think", "run_tests", "finish")]
    options = AgentConfig(max_turns=3, max_context_tokens=8000, max_output_chars=200)
    with Scorer(workers=1) as scorer:
        envs = [ToolEnvironment(TOK, options, scorer=scorer, tools=tools) for _ in range(2)]
        timing, t0 = {}, time.perf_counter()
        trajs = run_episodes(cont, envs, tasks, timing=timing)
        wall = time.perf_counter() - t0
        for env in envs:
            env.close()
    assert sorted(t.task_id for t in trajs) == sorted(t.id for t in tasks)  # the third refilled a slot
    assert 0 < timing["tools_s"] < wall  # sessions, tools and grading: part of the wall time
    for traj in trajs:
        tokens, mask, logprobs = traj.arrays()
        runs = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
        actions = [tokens[a:b].tolist() for a, b in zip(runs[::2], runs[1::2], strict=True)]
        assert len(actions) == traj.info["turns"] == 3  # a random policy runs out of turns
        assert traj.info["truncated"] and traj.info["masked"] and traj.info["bad_tool_calls"] >= 1
        sampled = [a for per_slot in cont.sampled.values() for a in per_slot]
        for (a, b), action in zip(zip(runs[::2], runs[1::2]), actions, strict=True):
            # every policy run is one sampled action, token for token, with its log-probs
            match = [lp for toks, lp in sampled if toks == action]
            assert len(match) == 1, "an action in the trajectory was not sampled (or twice)"
            np.testing.assert_array_equal(logprobs[a:b], match[0].astype(np.float32))
        np.testing.assert_array_equal(logprobs[~mask], 0.0)
        assert np.all(logprobs[mask] <= 0.0) and np.any(logprobs[mask] < 0.0)
        task = next(t for t in tasks if t.id == traj.task_id)
        prompt = TOK.encode(envs[0].format.prompt(TOK, task.prompt, envs[0].toolbox.schemas()))
        assert traj.tokens[: traj.prompt_len] == prompt and not mask[: traj.prompt_len].any()
