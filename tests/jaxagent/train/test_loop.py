"""The learner skips the update of a batch whose loss has no gradient: on a zero gradient Adam
would still move every weight by its momentum; it weighs a guided rollout as the policy's own."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxagent.config import load_config
from jaxagent.steps import policy_logprobs
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


def episodes_batch(rewards, rng):
    """Groups of four episodes of uneven lengths, tool output (policy mask 0) inside."""
    prompts = [rng.integers(3, 200, size=rng.integers(3, 8)).tolist() for _ in rewards[::4]]

    def rollout(prompt, reward):
        n = int(rng.integers(3, 12))
        return Rollout("t", prompt, rng.integers(3, 200, size=n).tolist(),
                       (rng.random(n) < 0.7).tolist(), (-rng.uniform(0.5, 3, size=n)).tolist(),
                       "", reward, "passed", "stop", 0)
    return RolloutBatch(0, 4, [rollout(prompts[i // 4], r) for i, r in enumerate(rewards)], {})


@pytest.mark.slow  # four updates' compiles in each layout
def test_packed_rows_update_as_the_padded_rows():
    """train.pack_tokens through the learner: two mini-batches of packed rows (each holding
    its mini-batch's episodes), micro-batches of two rows, the update's metrics those of the
    padded rows."""
    common = ["train.prompts_per_step=4", "train.share_prompt=false", "rl.mini_batches=2",
              "rl.ppo_epochs=2",
              "rl.entropy_coef=0.01", "rl.aggregation=seq-mean-token-mean"]
    padded, state = learner(*common, "train.micro_batch=2")
    packed, packed_state = learner(*common, "train.micro_batch=2", "train.pack_tokens=24")
    episodes = episodes_batch([1, 0, 0, 1, 0, 1, 0.5, 1] * 2, np.random.default_rng(11))
    rows = padded.prepare(episodes)[0]
    packed_rows, _, _, signal = packed.prepare(episodes)
    assert signal and packed_rows.packed and packed_rows.tokens.shape[1] == 24
    # per mini-batch a multiple of the 8 (test) data-parallel devices, several episodes a row
    assert packed_rows.size == 16 and np.asarray(packed_rows.segment_ids).max() > 1
    (_, want, _), (_, got, _) = (learner_.update(state_, r, None, 0) for learner_, state_, r in (
        (padded, state, rows), (packed, packed_state, packed_rows)))
    assert want.keys() == got.keys() and want["train/updates"] == 4
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-7, err_msg=key)


def test_packed_rows_without_signal_are_told_apart():
    packed = learner("train.share_prompt=false", "train.pack_tokens=32")[0]
    rng = np.random.default_rng(12)
    rows, _, _, signal = packed.prepare(episodes_batch([0, 0, 0, 0, 1, 1, 1, 1], rng))
    assert rows.packed and not signal
    assert packed.prepare(episodes_batch([0, 0, 0, 1, 1, 1, 1, 1], rng))[3]


@pytest.mark.parametrize("share", [False, True])
def test_rows_with_a_gradient_come_first(share):
    """The update runs only the micro-batches with a gradient (`rl_step`), so the learner packs
    those rows (whole groups, when they share a prompt) first."""
    learner_ = learner("rl.negative_scale=0", f"train.share_prompt={str(share).lower()}")[0]
    episodes = batch([0, 0, 0, 0, 0, 0, 1, 0], np.random.default_rng(5))
    rows = learner_.prepare(episodes)[0]
    adv = np.asarray(rows.advantages)
    at = 2 if share else 0  # the second group's rows first, in their order; or the episode
    assert adv[at] > 0 and np.count_nonzero(adv) == 1  # PSR: the one passing episode alone
    first = episodes.rollouts[6]
    if share:
        np.testing.assert_array_equal(np.asarray(rows.targets[2, :4]), first.completion)
        np.testing.assert_array_equal(np.asarray(rows.tokens[0, :5]), first.prompt)
    else:
        np.testing.assert_array_equal(np.asarray(rows.tokens[0, :9]),
                                      first.prompt + first.completion)


@pytest.mark.parametrize("packing", [["train.share_prompt=false", "train.pack_tokens=32"],
                                     ["train.share_prompt=true"]])
def test_a_guided_rollout_is_weighed_as_the_policy_s_own_sample(packing):
    """A scripted demonstration in a group (`agent.guidance`) carries placeholder log-probs;
    the learner gives its tokens the current policy's, so the update's importance weight and
    ratio on them are 1, and leaves every sampled token's as the sampler wrote it."""
    learner_, state = learner(*packing, "rl.negative_scale=0")
    episodes = episodes_batch([0, 0, 0, 0, 0, 0, 0, 0], np.random.default_rng(13))
    episodes.rollouts[3] = dataclasses.replace(episodes.rollouts[3], reward=1.0, guided=True,
                                               logprobs=[0.0] * len(episodes.rollouts[3].completion))
    rows, _, _, signal = learner_.prepare(episodes, state)
    assert signal
    with pytest.raises(ValueError, match="guided rollouts needs the state"):
        learner_.prepare(episodes)
    plain = learner_.prepare(dataclasses.replace(episodes, rollouts=[
        dataclasses.replace(r, guided=False) for r in episodes.rollouts]))[0]
    mask = np.asarray(rows.loss_mask) > 0
    marks = mask & (np.asarray(rows.advantages).reshape(len(mask), -1) > 0)
    assert marks.sum() == sum(episodes.rollouts[3].policy_mask)  # the demonstration's tokens
    want = np.asarray(policy_logprobs(learner_.graphdef, state.params, rows, state.frozen,
                                      sampling=learner_.options.sampling))
    got, before = np.asarray(rows.sampler_logprobs), np.asarray(plain.sampler_logprobs)
    np.testing.assert_allclose(got[marks], want[marks], rtol=1e-6)
    assert (got[marks] < 0).all() and (before[marks] == 0).all()
    np.testing.assert_array_equal(got[mask & ~marks], before[mask & ~marks])
    # the update raises the demonstration's tokens, as an on-policy pass's
    new_state, _, _ = learner_.update(state, rows, None, 0, signal=signal)
    after = np.asarray(policy_logprobs(learner_.graphdef, new_state.params, rows, state.frozen,
                                       sampling=learner_.options.sampling))
    assert after[marks].sum() > want[marks].sum() + 0.1
