import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxagent.config import OptimizerConfig
from jaxagent.models import Decoder, init_model
from jaxagent.models.config import DocumentConfig, ModelConfig
from jaxagent.optim import make_optimizer
from jaxagent.steps import (
    LossOptions,
    TrainBatch,
    answer_accuracy,
    feedback_term,
    greedy_misses,
    sampled_logprobs,
    pack,
    padded_length,
    pack_documents,
    pack_budget,
    pack_feedback,
    pack_shared,
    ppo_update,
    rl_step,
    sft_step,
    split_rows,
    target_logprobs,
)

CFG = ModelConfig(vocab_size=61, hidden_size=24, intermediate_size=37, num_layers=2, num_heads=3,
                  num_kv_heads=1, head_dim=8, tie_embeddings=False)


def random_rollouts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 61, rng.integers(3, 9)).tolist() for _ in range(n)]
    completions = [rng.integers(0, 61, rng.integers(1, 7)).tolist() for _ in range(n)]
    logprobs = [(-rng.random(len(c))).tolist() for c in completions]
    return prompts, completions, logprobs


def setup(lr=1e-2):
    graphdef, params = nnx.split(init_model(CFG, seed=0))
    tx = make_optimizer(OptimizerConfig(learning_rate=lr, max_grad_norm=0.0), 10)
    return graphdef, params, tx, tx.init(params)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def test_pack_masks_only_completion_targets():
    batch = pack([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], [[-0.1, -0.2], [-0.3, -0.4, -0.5]],
                 [1.0, -1.0], bucket=4)
    assert batch.tokens.shape == (2, 4)
    # Row 0: inputs 5 6 7 1 -> targets 6 7 1 2; the loss is on targets 1 and 2.
    np.testing.assert_array_equal(batch.tokens[0], [5, 6, 7, 1])
    np.testing.assert_array_equal(batch.targets[0], [6, 7, 1, 2])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1])
    np.testing.assert_allclose(batch.sampler_logprobs[0], [0, 0, -0.1, -0.2])
    np.testing.assert_array_equal(batch.loss_mask[1], [1, 1, 1, 0])
    np.testing.assert_array_equal(batch.segment_ids[1], [1, 1, 1, 1])
    np.testing.assert_array_equal(batch.segment_ids[0], [1, 1, 1, 1])


def test_equal_rewards_leave_the_policy_unchanged():
    graphdef, params, tx, opt_state = setup()
    before = copy(params)
    p, c, lp = random_rollouts()
    batch = pack(p, c, lp, np.zeros(len(p)))  # all-equal rewards -> zero advantages
    params, _, metrics = rl_step(graphdef, tx, params, opt_state, batch,
                                 options=LossOptions(kl_coef=0.0, entropy_coef=0.0))
    assert float(metrics["train/grad_norm"]) == 0.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_positive_advantage_raises_the_sequence_likelihood():
    graphdef, params, tx, opt_state = setup(lr=3e-3)
    p, c, lp = random_rollouts()
    adv = np.array([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    batch = pack(p, c, lp, adv)
    model = nnx.merge(graphdef, copy(params))
    before = np.asarray((target_logprobs(model, batch)[0] * batch.loss_mask).sum(-1))
    params, _, _ = rl_step(graphdef, tx, params, opt_state, batch,
                           options=LossOptions(importance_cap=None))
    after = np.asarray((target_logprobs(nnx.merge(graphdef, params), batch)[0]
                        * batch.loss_mask).sum(-1))
    assert np.all(np.sign(after - before) == np.sign(adv))


@pytest.mark.parametrize("aggregation", [
    "token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow),
    pytest.param("seq-mean-token-sum-norm", marks=pytest.mark.slow)])
def test_micro_batches_give_the_full_batch_gradient(aggregation):
    # Plain SGD, so the parameter change is the gradient itself (Adam would amplify
    # float noise in near-zero components).
    graphdef, params, _, _ = setup()
    tx = optax.sgd(1.0)
    opt_state = tx.init(params)
    p, c, lp = random_rollouts(n=6, seed=3)
    batch = pack(p, c, lp, np.random.default_rng(4).standard_normal(6))
    options = LossOptions(aggregation=aggregation, entropy_coef=0.01, kl_coef=0.1,
                          norm_length=7 if aggregation == "seq-mean-token-sum-norm" else None)
    ref = copy(params)
    full, _, m_full = rl_step(graphdef, tx, copy(params), opt_state, batch, ref,
                              options=options, micro_batch=0)
    micro, _, m_micro = rl_step(graphdef, tx, copy(params), tx.init(params), batch, ref,
                                options=options, micro_batch=2)
    np.testing.assert_allclose(float(m_full["train/loss"]), float(m_micro["train/loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m_full["train/grad_norm"]), float(m_micro["train/grad_norm"]),
                               rtol=1e-4)
    # The parameter changes are the gradients: equal up to float32 summation order, which
    # is far below what a wrong micro-batch weighting (a factor ~2 on some rows) would give.
    for p0, a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(full), jax.tree.leaves(micro)):
        np.testing.assert_allclose(a - p0, b - p0, atol=2e-5)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_without_a_gradient_are_skipped_exactly(aggregation):
    """Rows 2-5 have zero advantage: with micro-batches of 2, two of the three carry no
    gradient and are not run; the update is the whole batch's, and the token-mean metrics are
    those of the rows that ran."""
    graphdef, params, _, _ = setup()
    tx = optax.sgd(1.0)
    p, c, lp = random_rollouts(n=6, seed=5)
    adv = np.array([0.7, -1.3, 0.0, 0.0, 0.0, 0.0])
    batch = pack(p, c, lp, adv)
    options = LossOptions(aggregation=aggregation, importance_cap=None)
    ref = copy(params)
    full, _, m_full = rl_step(graphdef, tx, copy(params), tx.init(params), batch,
                              options=options, micro_batch=0)
    micro, _, m_micro = rl_step(graphdef, tx, copy(params), tx.init(params), batch,
                                options=options, micro_batch=2)
    np.testing.assert_allclose(float(m_full["train/loss"]), float(m_micro["train/loss"]), rtol=1e-5)
    for p0, a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(full), jax.tree.leaves(micro)):
        np.testing.assert_allclose(a - p0, b - p0, atol=2e-5)
    mask = np.asarray(batch.loss_mask)
    assert float(m_full["train/computed_tokens"]) == pytest.approx(1.0)
    assert float(m_micro["train/computed_tokens"]) == pytest.approx(mask[:2].sum() / mask.sum())
    # the entropy of the rows that ran: rows 0-1 alone, as one batch
    first = jax.tree.map(lambda x: x[:2], batch)
    _, _, m_first = rl_step(graphdef, tx, copy(params), tx.init(params), first, options=options)
    np.testing.assert_allclose(float(m_micro["train/entropy"]), float(m_first["train/entropy"]),
                               rtol=1e-5)
    assert float(m_full["train/entropy"]) != pytest.approx(float(m_first["train/entropy"]))
    # with a term that needs every row (the entropy bonus), every micro-batch runs
    _, _, m_all = rl_step(graphdef, tx, copy(params), tx.init(params), batch, micro_batch=2,
                          options=dataclasses.replace(options, entropy_coef=0.01))
    assert "train/computed_tokens" not in m_all
    np.testing.assert_allclose(float(m_all["train/entropy"]), float(m_full["train/entropy"]),
                               rtol=1e-5)


def test_sft_step_lowers_the_loss_on_its_batch():
    graphdef, params, tx, opt_state = setup(lr=1e-2)
    p, c, _ = random_rollouts()
    batch = pack(p, c)
    losses = []
    for _ in range(5):
        params, opt_state, m = sft_step(graphdef, tx, params, opt_state, batch)
        losses.append(float(m["sft/loss"]))
    assert losses[-1] < losses[0] - 0.1
    assert float(m["sft/tokens"]) == sum(map(len, c))


def test_micro_batch_must_divide_the_batch():
    graphdef, params, tx, opt_state = setup()
    p, c, lp = random_rollouts(n=6)
    with pytest.raises(ValueError, match=r"train.micro_batch \(4\) must divide the batch size \(6\)"):
        rl_step(graphdef, tx, params, opt_state, pack(p, c, lp, np.ones(6)),
                options=LossOptions(), micro_batch=4)


def grouped_rollouts(groups=3, g=4, seed=5):
    """Groups of `g` rows sharing a prompt, completions of uneven lengths (one of length 1)."""
    rng = np.random.default_rng(seed)
    prompts, completions = [], []
    for j in range(groups):
        prompt = rng.integers(0, 61, rng.integers(2, 11)).tolist()
        for i in range(g):
            prompts.append(prompt)
            completions.append(rng.integers(0, 61, 1 if (i, j) == (1, 0) else rng.integers(2, 9))
                               .tolist())
    logprobs = [(-rng.random(len(c))).tolist() for c in completions]
    return prompts, completions, logprobs


def test_pack_shared_layout():
    batch = pack_shared([[5, 6, 7]] * 2 + [[8]] * 2, [[1, 2], [3], [4, 9, 9], [2]],
                        [[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6], [-0.7]], [1.0, -1.0, 0.5, 0.0],
                        group_size=2, bucket=4)
    assert batch.tokens.shape == (2, 8) and batch.targets.shape == (4, 4)
    np.testing.assert_array_equal(batch.tokens[0], [5, 6, 7, 1, 2, 3, 0, 0])
    np.testing.assert_array_equal(batch.segment_ids[0], [1, 1, 1, -1, -1, -2, 0, 0])
    np.testing.assert_array_equal(batch.positions[0], [0, 1, 2, 3, 4, 3, 0, 0])
    # Completion 2 of group 0 (token 3) is predicted by the prompt's last column, 2.
    np.testing.assert_array_equal(batch.gather[:2], [[2, 3, 0, 0], [2, 0, 0, 0]])
    np.testing.assert_array_equal(batch.targets[1], [3, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[2], [1, 1, 1, 0])
    np.testing.assert_array_equal(batch.gather[2], [0, 1, 2, 0])
    np.testing.assert_allclose(batch.sampler_logprobs[3], [-0.7, 0, 0, 0])


def test_pack_shared_rejects_groups_without_one_prompt():
    with pytest.raises(ValueError, match="rows 0..1 do not share one prompt"):
        pack_shared([[1], [2]], [[3], [4]], group_size=2)
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        pack_shared([[1]] * 3, [[3]] * 3, group_size=2)


@pytest.mark.slow  # the step-equality tests below cover it
def test_shared_prompt_logprobs_equal_separate_sequences():
    p, c, lp = grouped_rollouts()
    model = nnx.merge(*setup()[:2])
    sep = pack(p, c, lp)
    shared = pack_shared(p, c, lp, group_size=4)
    logp_sep = np.asarray(target_logprobs(model, sep)[0])
    logp_shared = np.asarray(target_logprobs(model, shared)[0])
    for b in range(len(p)):
        got = logp_shared[b][np.asarray(shared.loss_mask[b]) > 0]
        want = logp_sep[b][np.asarray(sep.loss_mask[b]) > 0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregation,micro_batch", [
    ("token-mean", 0), pytest.param("seq-mean-token-mean", 4, marks=pytest.mark.slow),
    ("seq-mean-token-sum-norm", 4)])
def test_shared_prompt_step_equals_the_unshared_step(aggregation, micro_batch):
    graphdef, params, _, _ = setup()
    tx = optax.sgd(1.0)  # the parameter change is the gradient itself
    p, c, lp = grouped_rollouts(seed=11)
    adv = np.random.default_rng(12).standard_normal(len(p))
    options = LossOptions(aggregation=aggregation, entropy_coef=0.01, kl_coef=0.1,
                          norm_length=9 if aggregation == "seq-mean-token-sum-norm" else None)
    ref = jax.tree.map(lambda x: x + 0.01, params)  # a reference policy that differs
    sep, _, m_sep = rl_step(graphdef, tx, copy(params), tx.init(params), pack(p, c, lp, adv),
                            copy(ref), options=options, micro_batch=micro_batch)
    shared, _, m_shared = rl_step(graphdef, tx, copy(params), tx.init(params),
                                  pack_shared(p, c, lp, adv, group_size=4), copy(ref),
                                  options=options, micro_batch=micro_batch)
    for key in m_sep:
        np.testing.assert_allclose(float(m_shared[key]), float(m_sep[key]), rtol=2e-5,
                                   atol=1e-7, err_msg=key)
    for p0, a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sep), jax.tree.leaves(shared)):
        np.testing.assert_allclose(b - p0, a - p0, rtol=1e-4, atol=2e-6)


def test_shared_prompt_micro_batches_hold_whole_groups():
    graphdef, params, tx, opt_state = setup()
    p, c, lp = grouped_rollouts()
    with pytest.raises(ValueError, match=r"multiple of the group size \(4\)"):
        rl_step(graphdef, tx, params, opt_state, pack_shared(p, c, lp, np.ones(12), group_size=4),
                options=LossOptions(), micro_batch=6)


@pytest.mark.parametrize("shared", [pytest.param(False, marks=pytest.mark.slow), True])
def test_logits_chunks_give_the_whole_batch_step(shared):
    # Micro-batches of 6 rows and chunks of 18 tokens: 3 positions a chunk, the last padded.
    graphdef, params, _, _ = setup()
    tx = optax.sgd(1.0)  # the parameter change is the gradient itself
    p, c, lp = grouped_rollouts(g=3, groups=4, seed=17)
    adv = np.random.default_rng(18).standard_normal(len(p))
    batch = (pack_shared(p, c, lp, adv, group_size=3, bucket=1) if shared
             else pack(p, c, lp, adv, bucket=1))
    assert batch.targets.shape[1] % 3  # the last chunk is padded
    options = LossOptions(entropy_coef=0.01, kl_coef=0.1)
    ref = jax.tree.map(lambda x: x + 0.01, params)
    runs = [rl_step(graphdef, tx, copy(params), tx.init(params), batch, copy(ref),
                    options=options, micro_batch=6, logits_chunk=chunk) for chunk in (0, 18)]
    (whole, _, m_whole), (chunked, _, m_chunked) = runs
    for key in m_whole:
        np.testing.assert_allclose(float(m_chunked[key]), float(m_whole[key]), rtol=1e-5,
                                   atol=1e-7, err_msg=key)
    for p0, a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole),
                        jax.tree.leaves(chunked)):
        np.testing.assert_allclose(b - p0, a - p0, rtol=1e-4, atol=1e-6)


def test_answer_accuracy_in_chunks_counts_rows_whose_masked_targets_are_all_greedy():
    graphdef, params, _, _ = setup()
    rng = np.random.default_rng(19)
    b, t = 6, 11
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    greedy = np.asarray(jnp.argmax(nnx.merge(graphdef, params)(tokens), -1))
    mask = (rng.random((b, t)) < 0.6).astype(np.float32)
    mask[:, 4] = 1.0
    targets = greedy.copy()
    targets[[1, 4], 4] = (greedy[[1, 4], 4] + 1) % CFG.vocab_size  # a masked miss: wrong row
    targets[2] = np.where(mask[2] > 0, greedy[2], (greedy[2] + 1) % CFG.vocab_size)  # unmasked
    batch = TrainBatch(tokens=tokens, targets=jnp.asarray(targets), loss_mask=jnp.asarray(mask),
                       segment_ids=jnp.ones((b, t), jnp.int32),
                       sampler_logprobs=jnp.zeros((b, t)), advantages=jnp.zeros(b))
    for chunk in (0, 18):  # 3 positions a chunk, the last one padded
        assert float(answer_accuracy(graphdef, params, batch, chunk)) == pytest.approx(4 / 6)
        np.testing.assert_array_equal(greedy_misses(graphdef, params, batch, chunk),
                                      targets != greedy)


def test_sampled_logprobs_score_the_targets_under_the_sampler_s_distribution():
    """Teacher-forced log-probabilities of the targets under temperature and top-k, against a
    float64 NumPy softmax of the model's logits (a target top-k cuts: ~float32's minimum)."""
    graphdef, params, _, _ = setup()
    rng = np.random.default_rng(23)
    b, t = 5, 13
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    targets = rng.integers(0, CFG.vocab_size, (b, t))
    batch = TrainBatch(tokens=tokens, targets=jnp.asarray(targets, jnp.int32),
                       loss_mask=jnp.ones((b, t)), segment_ids=jnp.ones((b, t), jnp.int32),
                       sampler_logprobs=jnp.zeros((b, t)), advantages=jnp.zeros(b))
    logits = np.asarray(nnx.merge(graphdef, params)(tokens), np.float64)
    for temperature, top_k in ((0.5, None), (1.3, 7)):
        scaled = logits / temperature
        if top_k is not None:
            kth = np.sort(scaled, -1)[..., -top_k][..., None]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        ref = scaled - np.logaddexp.reduce(scaled, -1, keepdims=True)
        ref = np.take_along_axis(ref, targets[..., None], -1)[..., 0]
        for chunk in (0, 18):
            got = np.asarray(sampled_logprobs(graphdef, params, batch, (temperature, top_k, None),
                                              chunk))
            kept = np.isfinite(ref)
            np.testing.assert_allclose(got[kept], ref[kept], rtol=1e-4, atol=1e-4)
            assert (got[~kept] < -1e30).all() and (~kept).any() == (top_k is not None)


def test_logits_chunks_bound_the_step_memory():
    # Compiled only: XLA's buffer assignment says what the step needs beside its arguments.
    cfg = dataclasses.replace(CFG, vocab_size=8191, num_layers=1)
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    tx = optax.sgd(1.0)
    b, t = 4, 127
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t + 1))
    batch = pack([[int(x)] for x in tokens[:, 0]], tokens[:, 1:].tolist(), bucket=1)
    logits_bytes = b * t * cfg.vocab_size * 4
    temp = [rl_step.lower(graphdef, tx, params, tx.init(params), batch, options=LossOptions(),
                          logits_chunk=chunk).compile().memory_analysis().temp_size_in_bytes
            for chunk in (0, 64)]
    # Whole, the logits and their cotangent live at once (2.3x logits_bytes); in chunks of 16
    # positions, a few [4, 16, V] slices at a time (0.8x, of which 0.25x is not the LM head).
    assert temp[0] > 1.5 * logits_bytes
    assert temp[1] < temp[0] - 1.2 * logits_bytes, (temp, logits_bytes)


MOE = dataclasses.replace(CFG, num_layers=2, num_experts=5, num_experts_per_tok=2,
                          moe_intermediate_size=11, mlp_only_layers=(1,), router_aux_loss_coef=0.7)


@pytest.mark.parametrize("step", ["sft", pytest.param("rl", marks=pytest.mark.slow)])
def test_moe_aux_loss_is_in_the_gradient(step):
    """With SGD(lr=1) the update is -grad: raising the coefficient from 0 to c adds exactly
    -c * grad(load-balancing loss of this batch)."""
    p, c, lp = random_rollouts()
    batch = pack(p, c, lp, np.random.default_rng(5).normal(size=len(p)))
    graphdef, params = nnx.split(init_model(MOE, seed=1))
    tx = optax.sgd(1.0)

    def update(coef):
        # The coefficient is static config, part of the graphdef (built abstractly).
        cfg = dataclasses.replace(MOE, router_aux_loss_coef=coef)
        g = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
        new, _, metrics = (sft_step(g, tx, copy(params), tx.init(params), batch) if step == "sft"
                           else rl_step(g, tx, copy(params), tx.init(params), batch,
                                        options=LossOptions()))
        return jax.tree.map(jnp.subtract, new, params), metrics

    with_aux, metrics = update(MOE.router_aux_loss_coef)
    without, _ = update(0.0)

    def aux_of(p):
        return nnx.merge(graphdef, p)(batch.tokens, None, batch.segment_ids, with_aux_loss=True)[1]

    aux, aux_grad = jax.jit(jax.value_and_grad(aux_of))(params)
    prefix = "sft" if step == "sft" else "train"
    np.testing.assert_allclose(float(metrics[f"{prefix}/aux_loss"]), float(aux), rtol=1e-5)
    router = ("layers", 0, "mlp", "router")
    flat = dict(nnx.to_flat_state(aux_grad))
    assert np.abs(np.asarray(flat[router][...])).max() > 1e-3
    for a, b, g in zip(jax.tree.leaves(with_aux), jax.tree.leaves(without), jax.tree.leaves(aux_grad)):
        np.testing.assert_allclose(a - b, -MOE.router_aux_loss_coef * g, atol=1e-6)


@pytest.mark.parametrize("decoupled", [True, False])
def test_off_policy_loss_and_importance_weights_match_a_hand_computed_reference(decoupled):
    """Behaviour log-probs off the trainer's by random amounts (some ratios above the cap):
    the decoupled loss weights each token by min(pi_prox / pi_behav, cap) with the PPO ratio
    at 1; the plain form clips pi / pi_behav. Checked in float64 NumPy, over 3 micro-batches."""
    graphdef, params, tx, opt_state = setup()
    p, c, _ = random_rollouts(n=6, seed=5)
    rng = np.random.default_rng(7)
    adv = rng.normal(size=6)
    logp = np.float64(target_logprobs(nnx.merge(graphdef, params), pack(p, c))[0])
    mask = np.float64(pack(p, c).loss_mask)
    behaviour = logp + rng.normal(scale=0.5, size=logp.shape)
    # pack takes per-completion log-probs: position t of the packed batch predicts token t+1.
    lp = [behaviour[i, len(p[i]) - 1:len(p[i]) - 1 + len(c[i])].tolist() for i in range(6)]
    batch = pack(p, c, lp, adv)
    np.testing.assert_allclose(np.asarray(batch.sampler_logprobs)[mask > 0],
                               behaviour[mask > 0], rtol=1e-6)
    cap, eps = 1.3, 0.2
    _, _, m = rl_step(graphdef, tx, params, opt_state, batch, micro_batch=2,
                      options=LossOptions(importance_cap=cap, decoupled=decoupled))

    rho = np.exp(logp - np.float64(batch.sampler_logprobs))
    a = adv[:, None]
    if decoupled:
        w = np.minimum(rho, cap)
        per_token = -w * a  # proximal == current weights: the PPO ratio is exactly 1
        np.testing.assert_allclose(float(m["train/importance_weight"]),
                                   (w * mask).sum() / mask.sum(), rtol=1e-5)
    else:
        per_token = -np.minimum(rho * a, np.clip(rho, 1 - eps, 1 + eps) * a)
        assert "train/importance_weight" not in m
    np.testing.assert_allclose(float(m["train/loss"]), (per_token * mask).sum() / mask.sum(),
                               rtol=1e-5, atol=1e-7)
    on = mask > 0
    np.testing.assert_allclose(float(m["train/behaviour_ratio_mean"]), rho[on].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["train/behaviour_ratio_max"]), rho[on].max(), rtol=1e-5)
    clipped = (rho[on] > cap).mean()
    assert 0 < clipped < 1
    np.testing.assert_allclose(float(m["train/behaviour_clipped_fraction"]), clipped, rtol=1e-5)


def document_examples(seed=21, docs=4):
    rng = np.random.default_rng(seed)
    return [([rng.integers(0, 61, rng.integers(2, 9)).tolist() for _ in range(docs)],
             rng.integers(0, 61, rng.integers(1, 4)).tolist(),
             rng.integers(0, 61, rng.integers(1, 5)).tolist()) for _ in range(3)]


def test_pack_documents_layout():
    batch = pack_documents([([[5, 6], [7, 8, 9]], [3], [4, 2])], bucket=4)
    # Inputs: 8 tokens (the last one's target is padding), T rounded up to 8.
    np.testing.assert_array_equal(batch.tokens[0], [5, 6, 7, 8, 9, 3, 4, 2])
    np.testing.assert_array_equal(batch.segment_ids[0], [1, 1, 2, 2, 2, -1, -1, -1])
    np.testing.assert_array_equal(batch.positions[0], [0, 1, 0, 1, 2, 5, 6, 7])
    np.testing.assert_array_equal(batch.targets[0][:7], [6, 7, 8, 9, 3, 4, 2])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 0, 0, 0, 1, 1, 0])  # the answer
    with pytest.raises(ValueError, match="example 0: empty answer"):
        pack_documents([([[1]], [2], [])])


@pytest.mark.parametrize("restart", [True, False])
def test_document_order_changes_the_answer_only_without_restarted_positions(restart):
    """Documents restarting at position 0 and seeing only themselves make the final section
    invariant to their order (attention is a set operation over keys); running positions
    break it. Swapping another document's content always changes the answer's log-probs."""
    model = init_model(CFG, seed=3)
    cfg = DocumentConfig(restart_positions=restart)
    examples = document_examples()
    shuffled = [(d[::-1], q, a) for d, q, a in examples]
    edited = [([d[0], [(t + 1) % 61 for t in d[1]], *d[2:]], q, a) for d, q, a in examples]

    def answer_logprobs(rows):
        batch = pack_documents(rows, cfg)
        logp = np.asarray(target_logprobs(model, batch)[0])
        return logp[np.asarray(batch.loss_mask) > 0]

    base = answer_logprobs(examples)
    same = np.allclose(answer_logprobs(shuffled), base, rtol=1e-5, atol=1e-6)
    assert same == restart
    assert not np.allclose(answer_logprobs(edited), base, rtol=1e-5, atol=1e-6)


def feedback_examples(seed=0):
    """Two flagged turns of random sequences, each with a random 'hint' inserted before it."""
    rng = np.random.default_rng(seed)
    out = []
    for length, start, end, hint in [(17, 9, 14, 3), (11, 4, 11, 5)]:
        tokens = rng.integers(1, 61, length).tolist()
        teacher = tokens[:start] + rng.integers(1, 61, hint).tolist() + tokens[start:end]
        index = np.arange(start - 1, end - 1)
        out.append((tokens[:end], teacher, index, index + hint))
    return out


def test_pack_feedback_layout_and_limits():
    examples = feedback_examples()
    batch = pack_feedback(examples, rows=3, bucket=8)
    assert batch.student_tokens.shape == (3, 16) and batch.teacher_tokens.shape == (3, 24)
    assert batch.student_index.shape == batch.mask.shape == (3, 8)
    np.testing.assert_array_equal(batch.mask.sum(-1), [5, 7, 0])  # the third row is empty
    np.testing.assert_array_equal(batch.teacher_tokens[1], examples[1][1] + [0] * 8)
    np.testing.assert_array_equal(batch.student_segment_ids[0], [1] * 14 + [0] * 2)
    with pytest.raises(ValueError, match="3 feedback examples for 2 rows"):
        pack_feedback(examples + examples[:1], rows=2)
    # at least `length` wide (the trainer's row width), whatever the flagged contexts: one
    # compile of the update per width; a longer teacher context still fits
    for some, teacher_width in [(examples, 24), (examples[1:], 21), ([], 21)]:
        fixed = pack_feedback(some, rows=3, bucket=8, length=21)
        assert fixed.student_tokens.shape == (3, 21)
        assert fixed.teacher_tokens.shape == (3, teacher_width)
    np.testing.assert_array_equal(pack_feedback(examples, rows=3, bucket=8, length=21)
                                  .student_tokens[:, :16], batch.student_tokens)


def test_feedback_term_equals_float64_kl_and_the_step_reduces_it():
    """beta * token-mean KL(teacher || student) over the flagged tokens, from full forwards of
    the two contexts, in float64 (whole and with the LM head in chunks); then rl_step with zero
    advantages (only the feedback term pulls) moves the student towards the teacher."""
    graphdef, params, tx, opt_state = setup(lr=3e-2)
    jitted = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))  # eager is slow

    def forward(params, seq):  # right-padded to one length (causal: unseen), so one compile
        return jitted(params, jnp.asarray([seq + [0] * (24 - len(seq))]))[0, :len(seq)]

    examples = feedback_examples(1)
    beta = 0.3
    kl, count = 0.0, 0
    for student, teacher, s_index, t_index in examples:
        s = np.float64(forward(params, student))[s_index]
        t = np.float64(forward(params, teacher))[t_index]
        log_s = s - np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)) - s.max(-1, keepdims=True)
        log_t = t - np.log(np.exp(t - t.max(-1, keepdims=True)).sum(-1, keepdims=True)) - t.max(-1, keepdims=True)
        kl += (np.exp(log_t) * (log_t - log_s)).sum()
        count += len(s_index)
    want = beta * kl / count
    fb = pack_feedback(examples, rows=4, bucket=8)
    term = jax.jit(lambda params: feedback_term(nnx.merge(graphdef, params), fb, beta))
    got = float(term(params))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    chunked = jax.jit(lambda params: feedback_term(nnx.merge(graphdef, params), fb, beta, 12))
    np.testing.assert_allclose(float(chunked(params)), want, rtol=1e-4)  # 3 positions a chunk
    assert want > 1e-4  # the hint changes the distribution, so the test is not vacuous

    p, c, lp = random_rollouts(4, seed=3)
    batch = pack(p, c, lp, np.zeros(4))  # no policy-gradient signal
    options = LossOptions(feedback_beta=beta)
    new_params, _, m = rl_step(graphdef, tx, copy(params), opt_state, batch, None, fb,
                               options=options, logits_chunk=12)
    np.testing.assert_allclose(float(m["train/feedback_loss"]), want, rtol=1e-4)
    assert float(m["train/feedback_tokens"]) == count
    after = float(term(new_params))
    assert after < 0.9 * want


def float64_log_q(graphdef, params, examples):
    """Per example (student tokens, _, index, _): the float64 log-softmax at its index
    positions, from a full forward of its tokens."""
    jitted = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    out = []
    for seq, _, index, _ in examples:  # right-padded to one length (causal: unseen): one compile
        logits = np.float64(jitted(params, jnp.asarray([seq + [0] * (24 - len(seq))]))[0])[index]
        logits -= logits.max(-1, keepdims=True)
        out.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    return out


def assert_feedback_term_and_step(graphdef, params, tx, opt_state, fb, beta, want, tokens, drop):
    """`feedback_term` is `want` whole and with the LM head in chunks, and so is the step's
    logged loss; rl_step with zero advantages (only the feedback term pulls) lowers it below
    `drop` times itself."""
    term = jax.jit(lambda params: feedback_term(nnx.merge(graphdef, params), fb, beta))
    np.testing.assert_allclose(float(term(params)), want, rtol=1e-4)
    chunked = jax.jit(lambda params: feedback_term(nnx.merge(graphdef, params), fb, beta, 9))
    np.testing.assert_allclose(float(chunked(params)), want, rtol=1e-4)
    p, c, lp = random_rollouts(4, seed=3)
    new_params, _, m = rl_step(graphdef, tx, copy(params), opt_state, pack(p, c, lp, np.zeros(4)),
                               None, fb, options=LossOptions(feedback_beta=beta), logits_chunk=9)
    np.testing.assert_allclose(float(m["train/feedback_loss"]), want, rtol=1e-4)
    assert float(m["train/feedback_tokens"]) == tokens
    assert float(term(new_params)) < drop * want


def test_scripted_feedback_term_is_the_float64_nll_of_the_scripts_call_and_the_step_lowers_it():
    """Without teacher rows (`scripted`), beta * token-mean -log p(the script's call tokens)
    after each flagged turn's context, from full forwards in float64; rl_step with zero
    advantages raises the call's likelihood."""
    graphdef, params, tx, opt_state = setup(lr=3e-2)
    rng = np.random.default_rng(4)
    examples = []
    for start, call in [(9, 4), (5, 7)]:
        seq = rng.integers(1, 61, start + call).tolist()  # context, then the script's call
        examples.append((seq, None, np.arange(start - 1, start - 1 + call), None))
    fb = pack_feedback(examples, rows=3, bucket=8, teacher_rows=False)
    assert fb.teacher_tokens is None and fb.teacher_index is None
    np.testing.assert_array_equal(fb.targets[1, :7], examples[1][0][5:])
    np.testing.assert_array_equal(np.asarray(fb.mask).sum(-1), [4, 7, 0])
    with pytest.raises(ValueError, match="this teacher has no teacher context"):
        pack_feedback(feedback_examples(), rows=3, teacher_rows=False)
    nll = [-log_q[np.arange(len(e[2])), np.asarray(e[0])[e[2] + 1]]
           for e, log_q in zip(examples, float64_log_q(graphdef, params, examples), strict=True)]
    beta = 0.2
    assert_feedback_term_and_step(graphdef, params, tx, opt_state, fb, beta,
                                  beta * np.concatenate(nll).mean(), tokens=11, drop=0.9)


def test_grammar_feedback_term_is_the_float64_allowed_mass_and_the_step_raises_it():
    """With `allowed` (the grammar teacher), beta * token-mean -log q(the allowed tokens) at
    each flagged position, from full forwards in float64; rl_step with zero advantages moves
    mass onto the allowed tokens."""
    graphdef, params, tx, opt_state = setup(lr=3e-2)
    rng = np.random.default_rng(5)
    examples, allowed = [], []
    for start, turn in [(9, 5), (4, 8)]:
        seq = rng.integers(1, 61, start + turn).tolist()
        examples.append((seq, None, np.arange(start - 1, start - 1 + turn), None))
        allowed.append(rng.random((turn, CFG.vocab_size)) < 0.3)
    with pytest.raises(ValueError, match="2 allowed sets for 2 feedback examples with teacher"):
        pack_feedback(examples, rows=3, allowed=allowed)
    with pytest.raises(ValueError, match="5 student positions but 4 allowed sets"):
        pack_feedback(examples, rows=3, teacher_rows=False, allowed=[allowed[0][:4], allowed[1]])
    fb = pack_feedback(examples, rows=3, bucket=8, teacher_rows=False, allowed=allowed)
    assert fb.allowed.shape == (3, 8, CFG.vocab_size) and fb.teacher_tokens is None
    none = pack_feedback([], rows=3, bucket=8, teacher_rows=False, allowed=[],
                         vocab_size=CFG.vocab_size)  # a batch without a broken call: same shape
    assert none.allowed.shape == (3, 8, CFG.vocab_size) and not none.mask.any()
    mass = [-np.log(np.where(a, np.exp(log_q), 0.0).sum(-1))
            for a, log_q in zip(allowed, float64_log_q(graphdef, params, examples), strict=True)]
    beta = 0.5  # a random 30% of the vocabulary a position moves slower than one token
    assert_feedback_term_and_step(graphdef, params, tx, opt_state, fb, beta,
                                  beta * np.concatenate(mass).mean(), tokens=13, drop=0.95)


@pytest.mark.parametrize("sampling", [(0.6, 7, 0.9), pytest.param((0.6, None, None), marks=pytest.mark.slow),
                                      pytest.param((1.3, None, 0.8), marks=pytest.mark.slow)])
def test_on_policy_ratios_are_one_under_the_sampling_distribution(sampling):
    """The sampler draws at temperature T with top-k / top-p; the trainer's log-probs of the
    same tokens, with the same weights, under the same distribution: every ratio is 1. Under
    the plain softmax (what the trainer used before) they are not."""
    from rollouts.sampler import Sampler

    temperature, top_k, top_p = sampling
    model = init_model(CFG, seed=3)
    state = nnx.state(model, nnx.Param)  # peaked distributions, so truncation bites
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, state))
    prompts, _, _ = random_rollouts(n=3, seed=5)
    out = Sampler(model, prompt_bucket=8, cache_bucket=16, batch_bucket=4, host_threads=1).generate(
        prompts, num_samples=2, max_new_tokens=11, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=2)
    rows = [p for p in prompts for _ in range(2)]
    batch = pack(rows, out.tokens, out.logprobs, [1.0] * len(rows), bucket=8)
    mask = np.asarray(batch.loss_mask) > 0
    sampler_logp = np.asarray(batch.sampler_logprobs)[mask]
    logp = np.asarray(target_logprobs(model, batch, 0, sampling)[0])[mask]
    np.testing.assert_allclose(np.exp(logp - sampler_logp), 1.0, atol=2e-4)
    plain = np.asarray(target_logprobs(model, batch, 0)[0])[mask]
    assert np.abs(np.exp(plain - sampler_logp) - 1).max() > 0.05
    # and through rl_step's options: one decoupled step on-policy has behaviour ratio 1
    graphdef, params = nnx.split(model)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3, max_grad_norm=0.0), 10)
    _, _, metrics = rl_step(graphdef, tx, params, tx.init(params), batch,
                            options=LossOptions(sampling=sampling))
    assert abs(float(metrics["train/behaviour_ratio_max"]) - 1) < 1e-3


def test_ppo_epochs_and_mini_batches_clip_against_a_fixed_proximal_policy():
    """One update on a batch never clips (the ratio starts at 1); 3 epochs over 2 mini-batches
    do, because every update is measured against the log-probs taken before the first. The
    first of them is exactly rl_step on the first mini-batch, and one epoch over one
    mini-batch is rl_step itself."""
    from jaxagent.steps import policy_logprobs, ppo_update, split_rows

    prompts, completions, logprobs = random_rollouts(n=8, seed=4)
    adv = np.random.default_rng(1).normal(size=8).astype(np.float32)
    batch = pack(prompts, completions, logprobs, adv, bucket=8)
    graphdef, params, tx, opt = setup(lr=5e-2)
    options = LossOptions(importance_cap=None)

    once = rl_step(graphdef, tx, copy(params), copy(opt), batch, options=options)
    same = ppo_update(graphdef, tx, copy(params), copy(opt), [batch], options=options)
    jax.tree.map(np.testing.assert_array_equal, once[0], same[0])
    assert float(once[2]["train/clip_fraction"]) == 0.0

    minis = split_rows(batch, 2)
    assert [m.size for m in minis] == [4, 4]
    new, _, metrics = ppo_update(graphdef, tx, copy(params), copy(opt), minis, options=options,
                                 epochs=3)
    assert float(metrics["train/updates"]) == 6 and float(metrics["train/clip_fraction"]) > 0.05
    # by hand: the proximal log-probs once, then six steps in order
    proximal = [dataclasses.replace(m, proximal_logprobs=policy_logprobs(graphdef, params, m))
                for m in minis]
    p, o = copy(params), copy(opt)
    first = None
    for _ in range(3):
        for m in proximal:
            p, o, step = rl_step(graphdef, tx, p, o, m, options=options)
            first = first or step
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), new, p)
    alone = rl_step(graphdef, tx, copy(params), copy(opt), minis[0], options=options)[2]
    np.testing.assert_allclose(first["train/loss"], alone["train/loss"], rtol=1e-6)


def test_remat_step_with_a_kl_reference_equals_the_plain_one():
    """nnx.remat under the gradient with the reference's Variables made outside it (it raised
    "Cannot mutate Param from a different trace level")."""
    p, c, lp = random_rollouts()
    batch = pack(p, c, lp, np.linspace(-1, 1, 6))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, max_grad_norm=0.0), 10)
    metrics = []
    for remat in ("none", "full"):
        graphdef, params = nnx.split(init_model(dataclasses.replace(CFG, remat=remat), seed=0))
        _, _, m = rl_step(graphdef, tx, copy(params), tx.init(params), batch, copy(params),
                          options=LossOptions(kl_coef=0.5))
        metrics.append(m)
    np.testing.assert_allclose(metrics[1]["train/grad_norm"], metrics[0]["train/grad_norm"],
                               rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Packing by token budget (train.pack_tokens).


def episodes(n=8, seed=21):
    """Rollouts of distinct odd lengths (one with an empty prompt), masks with tool-output gaps
    (one all-zero: a dropped group's), behaviour log-probs near the tiny model's (about -ln 61,
    so the importance weights spread around 1 and some pass the cap), random advantages."""
    rng = np.random.default_rng(seed)
    totals = rng.permutation(np.arange(5, 5 + 4 * n, 4) + rng.integers(0, 2, n) * 2)
    prompts, completions, masks = [], [], []
    for i, total in enumerate(totals):
        lp = 0 if i == 1 else int(rng.integers(1, total - 1))
        prompts.append(rng.integers(0, 61, lp).tolist())
        completions.append(rng.integers(0, 61, total - lp).tolist())
        masks.append((rng.random(total - lp) < 0.7).astype(float).tolist())
    masks[3] = [0.0] * len(masks[3])
    logprobs = [(-4.1 + 0.6 * rng.standard_normal(len(c))).tolist() for c in completions]
    return prompts, completions, logprobs, rng.standard_normal(n), masks


def test_pack_budget_layout():
    # Lengths 6, 4, 3, 2 into rows of 7, first fit by decreasing length: [6], [4, 3], [2], and
    # an empty fourth row (a multiple of 2 rows).
    prompts, completions = [[1, 2], [3], [], [4]], [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14], [15]]
    masks = [[1, 0, 1, 1], [1, 1, 1], [1, 1, 1], [1]]
    batch = pack_budget(prompts, completions, [[-1.0] * len(c) for c in completions],
                        [0.5, -1.0, 2.0, 3.0], budget=7, row_multiple=2, completion_masks=masks)
    assert batch.packed and batch.tokens.shape == (4, 7)
    full = np.concatenate([np.asarray(batch.tokens), np.asarray(batch.targets)[:, -1:]], 1)
    np.testing.assert_array_equal(full[0], [1, 2, 5, 6, 7, 8, 0, 0])
    np.testing.assert_array_equal(full[1], [3, 9, 10, 11, 12, 13, 14, 0])
    np.testing.assert_array_equal(full[2], [4, 15, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(full[3], 0)  # an empty row: no loss
    np.testing.assert_array_equal(batch.segment_ids[1], [1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(batch.positions[1], [0, 1, 2, 3, 0, 1, 2])
    # Targets 9 10 11 | 12 13 14: 12 opens rollout 2 (empty prompt), nothing in it predicts it.
    np.testing.assert_array_equal(batch.loss_mask[1], [1, 1, 1, 0, 1, 1, 0])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 1, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.advantages[1], [-1, -1, -1, 2, 2, 2, 0])
    np.testing.assert_array_equal(batch.sampler_logprobs[1], [-1, -1, -1, 0, -1, -1, 0])
    np.testing.assert_array_equal(batch.loss_mask[3], 0)


def test_pack_budget_packs_each_mini_batch_apart():
    p, c, lp, adv, masks = episodes()
    batch = pack_budget(p, c, lp, adv, budget=48, parts=2, row_multiple=3, completion_masks=masks)
    halves = split_rows(batch, 2)
    for half, rollouts in zip(halves, (range(4), range(4, 8))):
        assert half.size % 3 == 0
        # the half holds exactly its rollouts' tokens and loss-masked targets
        assert int((np.asarray(half.segment_ids) > 0).sum()) == sum(
            len(p[i]) + len(c[i]) for i in rollouts)
        want = sum(sum(masks[i][1:] if not p[i] else masks[i]) for i in rollouts)
        assert float(np.asarray(half.loss_mask).sum()) == want


def test_pack_budget_rejects_a_rollout_over_the_budget():
    with pytest.raises(ValueError,
                       match=r"rollout 1 has 9 tokens, more than train.pack_tokens \(8\)"):
        pack_budget([[1], [2, 3]], [[4], [5] * 7], budget=8)


def test_packed_rollouts_do_not_see_each_other():
    """Each rollout's target log-probs are the same packed with others as packed alone (and as
    in the padded layout): no token attends across rollouts, positions restart per rollout."""
    p, c, _, _, _ = episodes()
    model = init_model(CFG, seed=1)
    logprobs = nnx.jit(lambda m, batch: target_logprobs(m, batch)[0])
    packed = pack_budget(p, c, budget=64)
    assert packed.size < len(p)
    logp = np.asarray(logprobs(model, packed))
    seg, targets = np.asarray(packed.segment_ids), np.asarray(packed.targets)
    padded = np.asarray(logprobs(model, pack(p, c)))
    alone = jax.tree.map(lambda *rows: jnp.concatenate(rows), *(
        pack_budget([p[i]], [c[i]], budget=64) for i in range(len(p))))  # one rollout a row
    alone = np.asarray(logprobs(model, alone))
    found = 0
    for i in range(len(p)):
        want = alone[i, :len(p[i]) + len(c[i]) - 1]
        np.testing.assert_allclose(want, padded[i, :len(want)], rtol=1e-5, atol=1e-5)
        # find rollout i in the packed rows by its tokens
        for r in range(packed.size):
            for k in range(1, seg[r].max() + 1):
                cols = np.flatnonzero(seg[r] == k)
                if len(cols) == len(want) + 1 and np.array_equal(
                        targets[r, cols[:-1]], (p[i] + c[i])[1:]):
                    np.testing.assert_allclose(logp[r, cols[:-1]], want, rtol=1e-5, atol=1e-5)
                    found += 1
    assert found == len(p)


def assert_same_step(a, b, params):
    """Two (params, opt_state, metrics) results of one update: equal metrics and changes."""
    (pa, _, ma), (pb, _, mb) = a, b
    assert ma.keys() == mb.keys()
    for key in ma:
        np.testing.assert_allclose(float(mb[key]), float(ma[key]), rtol=2e-5, atol=1e-7,
                                   err_msg=key)
    for p0, x, y in zip(jax.tree.leaves(params), jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(y - p0, x - p0, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("aggregation", [
    "token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow),
    "seq-mean-token-sum-norm"])  # seq-mean-token-mean: also the ppo_update test's
def test_packed_step_equals_the_padded_step(aggregation):
    graphdef, params, _, _ = setup()
    tx = optax.sgd(1.0)  # the parameter change is the gradient itself
    p, c, lp, adv, masks = episodes(seed=23)
    options = LossOptions(aggregation=aggregation, entropy_coef=0.01, kl_coef=0.1,
                          norm_length=13 if aggregation == "seq-mean-token-sum-norm" else None)
    ref = jax.tree.map(lambda x: x + 0.01, params)  # a reference policy that differs
    padded = pack(p, c, lp, adv, completion_masks=masks)
    packed = pack_budget(p, c, lp, adv, budget=48, row_multiple=2, completion_masks=masks)
    assert packed.size < padded.size
    runs = [rl_step(graphdef, tx, copy(params), tx.init(params), batch, copy(ref),
                    options=options, micro_batch=2) for batch in (padded, packed)]
    assert float(runs[0][2]["train/importance_weight"]) != 1.0  # the weights act
    assert_same_step(*runs, params)


def test_packed_ppo_update_equals_the_padded_update():
    """Two epochs over two mini-batches (the clip and the proximal log-probs act): the packed
    mini-batches hold the padded ones' rollouts."""
    graphdef, params, _, _ = setup()
    tx = optax.sgd(0.5)
    p, c, lp, adv, masks = episodes(seed=25)
    options = LossOptions(aggregation="seq-mean-token-mean", entropy_coef=0.01, clip_low=0.01,
                          clip_high=0.01)
    padded = split_rows(pack(p, c, lp, adv, completion_masks=masks), 2)
    packed = split_rows(pack_budget(p, c, lp, adv, budget=48, parts=2, completion_masks=masks), 2)
    runs = [ppo_update(graphdef, tx, copy(params), tx.init(params), minis, options=options,
                       epochs=2) for minis in (padded, packed)]
    assert float(runs[0][2]["train/clip_fraction"]) > 0  # later updates move the ratio
    assert_same_step(*runs, params)


def test_micro_batches_weigh_token_means_by_their_tokens():
    """With a sequence-level aggregation the entropy and the token-mean metrics still add up,
    micro-batch by micro-batch, to the whole batch's token means."""
    graphdef, params, _, _ = setup()
    tx = optax.sgd(1.0)
    p, c, lp, adv, masks = episodes(seed=27)
    batch = pack(p, c, lp, adv, completion_masks=masks)
    options = LossOptions(aggregation="seq-mean-token-mean", entropy_coef=0.5)
    runs = [rl_step(graphdef, tx, copy(params), tx.init(params), batch, options=options,
                    micro_batch=m) for m in (0, 2)]
    assert_same_step(*runs, params)


def test_padded_lengths_are_few_and_pad_at_most_a_quarter():
    """RL rows' longest episode wanders from step to step, and each new padded length is a
    compile of the update: past 4 buckets there are 4 lengths a doubling."""
    lengths = [padded_length(n, 32) for n in range(1, 4097)]
    assert lengths[:128] == [32 * -(-n // 32) for n in range(1, 129)]  # up to 4 buckets
    assert all(n <= t < n + max(32, n / 4) for n, t in zip(range(1, 4097), lengths))
    for lo in (256, 512, 1024, 2048):
        assert len(set(lengths[lo:2 * lo])) == 4  # (lo, 2 lo]
    assert padded_length(40, 40) == 40  # one bucket as long as the rows: exact
    batch = pack([[1] * 300], [[2] * 300], bucket=32)  # inputs: 599 tokens
    assert batch.tokens.shape == (1, padded_length(599, 32)) == (1, 640)
