"""The learner skips the update of a batch whose loss has no gradient: on a zero gradient Adam
would still move every weight by its momentum."""

import jax
import numpy as np
import pytest

from jaxagent.config import load_config
from jaxagent.train.build import load_model_and_tokenizer, rl_layout, validate
from jaxagent.train.loop import Learner
from rollouts.producer import Rollout, RolloutBatch

TINY = ["model.num_layers=1", "model.hidden_size=24", "model.intermediate_size=40",
        "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=12",
        "train.prompts_per_step=2", "rl.group_size=4", "rl.algorithm=rloo",
        "optim.learning_rate=1e-2"]


def learner(*overrides):
    cfg = validate(load_config(None, [*TINY, *overrides]))
    layout = rl_layout(cfg)
    model, tokenizer = load_model_and_tokenizer(cfg, layout=layout)
    return Learner.create(cfg, model, tokenizer, layout)


def batch(rewards, rng):
    """Two groups of four episodes over fresh random tokens (a prompt per group), with these
    rewards; every batch the same shape (one compiled update)."""
    prompts = [rng.integers(3, 200, size=5).tolist() for _ in range(2)]

    def rollout(prompt, reward, n=4):
        return Rollout("t", prompt, rng.integers(3, 200, size=n).tolist(), [True] * n,
                       (-rng.uniform(0.5, 3, size=n)).tolist(), "", reward, "passed", "stop", 0)
    return RolloutBatch(0, 4, [rollout(prompts[i // 4], r) for i, r in enumerate(rewards)], {})


def snapshot(state):
    return jax.tree.map(np.asarray, state.arrays())


def test_a_batch_without_signal_leaves_weights_and_moments_as_they_were():
    rng = np.random.default_rng(7)
    learner_, state = learner()
    rows, feedback, _, signal = learner_.prepare(batch([1, 0, 0, 1, 0, 1, 1, 1], rng))
    assert signal
    before = snapshot(state)
    state, metrics, _ = learner_.update(state, rows, feedback, 0, signal=signal)
    after_first = snapshot(state)
    assert metrics["train/skipped_update"] == 0.0
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                         jax.tree.leaves(after_first)))
    # All-equal rewards in every group: every advantage is 0. Adam's moments are not zero
    # after the first update, so an update here would move the weights.
    rows, feedback, _, signal = learner_.prepare(batch([0, 0, 0, 0, 1, 1, 1, 1], rng))
    assert not signal
    state, metrics, _ = learner_.update(state, rows, feedback, 1, signal=signal)
    assert metrics == {"train/loss": 0.0, "train/skipped_update": 1.0}
    jax.tree.map(np.testing.assert_array_equal, snapshot(state), after_first)
    # The same batch updated regardless: the momentum moves the weights.
    state, _, _ = learner_.update(state, rows, feedback, 1, signal=True)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after_first),
                                                         jax.tree.leaves(snapshot(state))))


@pytest.mark.parametrize("term", ["rl.entropy_coef=0.01", "rl.kl_coef=0.05"])
def test_a_term_without_advantages_is_signal(term):
    rows, _, _, signal = learner(term)[0].prepare(batch([0.5] * 8, np.random.default_rng(3)))
    assert not np.asarray(rows.advantages).any() and signal
