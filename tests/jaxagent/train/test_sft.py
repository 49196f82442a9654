"""The agent warm-up's recovery demonstrations (`sft.recovery`): which tasks play them, what
they play, and what of them carries loss; its validation (`sft.valid_tasks`): which tokens each
call's exactness reads."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxagent.config import ConfigError, load_config
from jaxagent.tokenizer import ByteTokenizer, HFTokenizer
from jaxagent.train.build import model_tokenizer, tool_env_factory, validate
from jaxagent.train.sft import (_agent_demonstrations, _sft_data, call_exactness, fit_tokenizer,
                                recovers, script_chance, stop_share,
                                validation_rows)
from rollouts.agent.demos import demonstrate, scripted_calls
from rollouts.agent.formats import make_format
from rollouts.rewards import Scorer
from rollouts.tasks import synthetic_tasks
from rollouts.tasks.agent_family import agent_family_tasks, whole

TOK = ByteTokenizer()
AGENT = "configs/agent_default.yaml"  # replace_line, compact calls, redrawn facts


def _cfg(*overrides):
    return load_config(AGENT, ["rewards.workers=1", *overrides])


def test_recovery_picks_a_share_of_the_tasks_from_the_seed():
    tasks = agent_family_tasks(400, seed=0, names="fixed")
    half = recovers(_cfg("sft.recovery=0.5"), tasks)
    assert half == recovers(_cfg("sft.recovery=0.5"), tasks)  # a resumed run draws the same
    assert half != recovers(_cfg("sft.recovery=0.5", "seed=1"), tasks)
    assert 160 <= sum(half) <= 240
    assert not any(recovers(_cfg(), tasks)) and all(recovers(_cfg("sft.recovery=1"), tasks))
    # a larger share keeps the smaller one's recoveries (one draw per task)
    assert all(b for a, b in zip(half, recovers(_cfg("sft.recovery=0.7"), tasks)) if a)


def test_a_share_of_0_plays_the_ordinary_demonstrations():
    tasks = agent_family_tasks(1, seed=3, names="fixed")
    played = _agent_demonstrations(_cfg(), TOK, tasks)
    with Scorer(workers=1) as scorer:
        make_env = tool_env_factory(_cfg(), TOK, scorer)
        for task, (traj, calls, wrong) in zip(tasks, played):
            env = make_env()
            want = demonstrate(env, task, scripted_calls(task, "replace_line"))
            env.close()
            assert calls == scripted_calls(task, "replace_line") and wrong == []
            assert (traj.tokens, traj.policy_mask) == (want.tokens, want.policy_mask)


def test_a_recovery_script_longer_than_max_turns_is_a_config_error():
    tasks = agent_family_tasks(1, seed=3, names="fixed")
    with pytest.raises(ConfigError, match=r"sft\.recovery: .* 7 calls but agent\.max_turns "
                                          r"is 6"):
        _agent_demonstrations(_cfg("sft.recovery=1"), TOK, tasks)


def test_recovery_rows_carry_no_loss_on_the_wrong_edit_and_the_usual_loss_on_the_fix():
    """Drawn warm-up rows (facts redrawn, `sft.fact_weight` on them): the wrong edit is in the
    row with weight 0, the failing run's output (holding the fact) is context, the fix and the
    calls after it weigh as in an ordinary demonstration, the fix's fact tokens more."""
    tasks = agent_family_tasks(2, seed=3, names="fixed", templates=["constant", "edge_case"])
    # enough rows that a redrawn value would meet the constant's guess (~1 in 90) somewhere
    cfg = _cfg("sft.recovery=1", "agent.max_turns=7", "sft.batch_size=400")
    draw, _, _ = _sft_data(cfg, TOK, tasks)
    batch = draw(np.random.default_rng(0))
    edit = TOK.encode("@replace_line ")  # the compact format's calls
    with_facts = 0
    for row, weights in zip(np.asarray(batch.targets), np.asarray(batch.loss_mask)):
        row, weights = list(row), list(weights)
        starts = [i for i in range(len(row)) if row[i:i + len(edit)] == edit]
        assert len(starts) == 2, TOK.decode(row)  # the wrong edit, then the fix
        (guess, fix) = [(a, row.index(TOK.eos_id, a) + 1) for a in starts]
        assert row[guess[0]:guess[1]] != row[fix[0]:fix[1]]
        assert not any(weights[guess[0]:guess[1]])
        turn = weights[fix[0]:fix[1]]
        assert min(turn) > 0
        # the fact's tokens weigh more (unless the draw's facts coincided: no redraw)
        has_fact = max(turn) == pytest.approx(min(turn) + cfg.sft.fact_weight)
        assert has_fact or max(turn) == pytest.approx(min(turn))
        with_facts += has_fact
        after = weights[fix[1]:]
        assert sum(after) == pytest.approx(2.0)  # run_tests and finish: weight 1 each
        # the fix writes the value the failing run showed, which the guess did not write
        failed = TOK.decode(row[guess[1]:fix[0]])
        value = re.search(r"assert \S+ == (-?\d+)", failed).group(1)
        assert whole([value]).search(TOK.decode(row[fix[0]:fix[1]]))
        assert not whole([value]).search(TOK.decode(row[guess[0]:guess[1]]))
    assert with_facts > 0.9 * len(batch.targets)


def test_observation_weight_weighs_every_token_the_environment_wrote():
    """`sft.observation_weight`: the prompt and every tool output weigh that much a token (the
    BOS, never a target, nothing); the actions keep their turn weights, the same as without."""
    tasks = agent_family_tasks(2, seed=5, names="fixed", templates=["constant", "hidden_file"])
    # facts as played, so each row is one of the played demonstrations token for token
    base = ["sft.batch_size=8", "sft.fact_weight=0", "sft.redraw_facts=false"]
    plain, _, _ = _sft_data(_cfg(*base), TOK, tasks)
    weighed, _, _ = _sft_data(_cfg(*base, "sft.observation_weight=0.02"), TOK, tasks)
    a, b = plain(np.random.default_rng(4)), weighed(np.random.default_rng(4))
    np.testing.assert_array_equal(a.targets, b.targets)
    played = {tuple(t.tokens[1:]): t for t, _, _ in _agent_demonstrations(_cfg(), TOK, tasks)}
    seen = set()
    for row, plain_w, w in zip(np.asarray(a.targets), np.asarray(a.loss_mask),
                               np.asarray(b.loss_mask)):
        key, traj = next((k, t) for k, t in played.items() if tuple(row[:len(k)]) == k)
        seen.add(key)
        n = len(traj.tokens) - 1
        policy = np.asarray(traj.policy_mask[1:])
        assert policy.sum() and (~policy).sum() > 300  # a prompt and tool outputs
        np.testing.assert_allclose(w[:n][policy], plain_w[:n][policy])
        np.testing.assert_allclose(w[:n][~policy], 0.02)
        assert not plain_w[:n][~policy].any() and not w[n:].any()  # padding: nothing
        calls = np.diff(np.concatenate([[0], policy.astype(int)])).clip(0).sum()
        assert calls >= 5 and sum(plain_w) == pytest.approx(calls, rel=1e-5)  # 1 a call
    assert len(seen) == 2  # rows of both templates


def test_observation_weight_leaves_a_recoverys_wrong_edit_without_loss():
    tasks = agent_family_tasks(1, seed=3, names="fixed", templates=["constant"])
    cfg = _cfg("sft.recovery=1", "agent.max_turns=7", "sft.batch_size=2",
               "sft.observation_weight=0.02")
    draw, _, _ = _sft_data(cfg, TOK, tasks)
    batch = draw(np.random.default_rng(0))
    edit = TOK.encode("@replace_line ")
    for row, weights in zip(np.asarray(batch.targets), np.asarray(batch.loss_mask)):
        row = list(row)
        guess = next(i for i in range(len(row)) if row[i:i + len(edit)] == edit)
        end = row.index(TOK.eos_id, guess) + 1
        assert not weights[guess:end].any()  # neither a turn's weight nor the observations'
        assert weights[guess - 1] == pytest.approx(0.02)  # the tool output before it


def test_validation_rows_name_each_calls_target_tokens():
    """Validation demonstrations: with `sft.recovery` 1 they still play the ordinary script,
    and each call's span in the packed row holds exactly that call's rendered tokens."""
    tasks = agent_family_tasks(3, seed=5, names="fixed")
    played = _agent_demonstrations(_cfg("sft.recovery=1", "agent.max_turns=7"), TOK, tasks,
                                   recovery=False)
    batch, calls = validation_rows(played)
    render = make_format("compact").render_call
    targets = np.asarray(batch.targets)
    assert targets.shape[0] == 3 and len({len(c) for c in calls}) > 1  # hidden_file: 2 reads
    for row, (task, spans, (_, script, wrong)) in enumerate(zip(tasks, calls, played)):
        assert wrong == [] and script == scripted_calls(task, "replace_line")
        assert [tool for _, _, tool in spans] == [c.name for c in script]
        for (a, b, _), call in zip(spans, script):
            assert list(targets[row, a:b]) == TOK.encode(render(call)) + [TOK.eos_id]
            assert np.asarray(batch.loss_mask)[row, a:b].all()


def test_call_exactness_counts_calls_and_rows_without_a_miss():
    calls = [[(0, 3, "run_tests"), (5, 9, "replace_line")],
             [(0, 2, "run_tests"), (4, 6, "read_file"), (7, 12, "replace_line")]]
    miss = np.zeros((2, 12), bool)
    miss[0, 4] = miss[1, 6] = True  # between calls: counts for none
    assert call_exactness(miss, calls) == {"episode": 1.0, "read_file": 1.0,
                                           "replace_line": 1.0, "run_tests": 1.0}
    miss[1, 11] = True  # the last token of the second row's edit
    assert call_exactness(miss, calls) == {"episode": 0.5, "read_file": 1.0,
                                           "replace_line": 0.5, "run_tests": 1.0}
    assert call_exactness(miss, calls, ["constant", "hidden_file"]) == {
        "episode": 0.5, "episode/constant": 1.0, "episode/hidden_file": 0.0, "read_file": 1.0,
        "replace_line": 0.5, "run_tests": 1.0}
    miss[0, 0] = True
    assert call_exactness(miss, calls)["episode"] == 0.0
    assert call_exactness(miss, calls)["run_tests"] == 0.5


def test_script_chance_is_the_mean_chance_of_sampling_every_call_as_written():
    """Per row, exp of the log-probabilities summed over its calls' spans (none between
    calls), averaged over rows and over each group's rows; a float64 reference."""
    rng = np.random.default_rng(11)
    calls = [[(0, 3, "run_tests"), (5, 9, "replace_line")],
             [(0, 2, "run_tests"), (4, 6, "read_file"), (7, 12, "replace_line")],
             [(1, 4, "run_tests")]]
    logp = np.log(rng.uniform(0.3, 1.0, (3, 12))).astype(np.float32)
    chance = [np.exp(logp[0, 0:3].astype(np.float64).sum() + logp[0, 5:9].sum()),
              np.exp(logp[1, 0:2].sum() + logp[1, 4:6].sum() + logp[1, 7:12].sum()),
              np.exp(logp[2, 1:4].sum())]
    got = script_chance(logp, calls, ["keyed", "plain", "keyed"])
    assert got.keys() == {"episode", "episode/keyed", "episode/plain"}
    assert got["episode"] == pytest.approx(np.mean(chance), rel=1e-5)
    assert got["episode/keyed"] == pytest.approx((chance[0] + chance[2]) / 2, rel=1e-5)
    assert got["episode/plain"] == pytest.approx(chance[1], rel=1e-5)
    logp[0, 4] = logp[1, 3] = -50.0  # between calls: no change
    assert script_chance(logp, calls, ["keyed", "plain", "keyed"]) == pytest.approx(got)


@pytest.mark.slow  # ~1 min: plays demonstrations, compiles a 1.5k-token SFT step
def test_the_warm_up_stops_at_the_first_validation_that_reaches_valid_stop(monkeypatch):
    """`sft.valid_stop`: the steps stop after the validation that reaches the share (here
    the third, at step 6 of 10), each validation is logged, and `sft/steps` says where."""
    import jax

    from jaxagent.models import init_model
    from jaxagent.models.adapters import split_trainable
    from jaxagent.train import sft as sft_module
    from sharding.layout import Layout

    shares = iter([0.0, 0.25, 0.5, 1.0, 1.0])
    monkeypatch.setattr(sft_module, "_agent_validation", lambda *a: lambda params: {
        "sft/valid_exact/episode": next(shares)})
    cfg = _cfg("sft.steps=10", "sft.batch_size=8", "sft.valid_tasks=2", "sft.valid_every=2",
               "sft.valid_stop=0.5", "sft.fact_weight=0", "sft.redraw_facts=false",
               "model.num_layers=1")
    layout = Layout(cfg.mesh, cfg.sampler.mesh)
    graphdef, weights = layout.split(init_model(cfg.model, seed=0))
    params, _ = split_trainable(weights)
    logged = []
    before = jax.tree.leaves(params)[0].copy()
    params, metrics = sft_module.sft(cfg, graphdef, params, TOK,
                                     agent_family_tasks(2, seed=3, names="fixed"), layout,
                                     log=lambda step, row: logged.append((step, row)))
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6]
    assert [row["sft/valid_exact/episode"] for step, row in logged if step % 2 == 0] == [
        0.0, 0.25, 0.5]
    assert metrics["sft/steps"] == 6 and metrics["sft/valid_exact/episode"] == 0.5
    assert all(0 < row["sft/loss"] < 10 for _, row in logged)
    assert not np.array_equal(jax.tree.leaves(params)[0], before)


def test_valid_stop_by_template_reads_the_least_template():
    exact = {"sft/valid_exact/episode": 0.5, "sft/valid_exact/read_file": 0.95,
             "sft/valid_exact/episode/exception": 0.9, "sft/valid_exact/episode/keyed": 0.1}
    assert stop_share(exact, "episode") == 0.5 and stop_share(exact, "template") == 0.1
    assert stop_share({**exact, "sft/valid_sampled/episode": 0.3,
                       "sft/valid_sampled/episode/keyed": 0.05}, "sampled") == 0.3
    assert _cfg("sft.valid_stop_by=sampled").sft.valid_stop_by == "sampled"
    assert _cfg("sft.valid_stop_by=template").sft.valid_stop_by == "template"
    with pytest.raises(ConfigError, match="sft.valid_stop_by"):
        _cfg("sft.valid_stop_by=tool")


def test_fit_tokenizer_learns_a_bpe_from_byte_demonstrations_once(tmp_path):
    """model.tokenizer: bpe: the run's BPE is learnt from its demonstrations played in bytes,
    loads as the model's tokenizer, plays the same episodes (the same text, ~3x fewer tokens),
    and is kept, not relearnt, when the run starts again."""
    cfg = _cfg("model.tokenizer=bpe", "model.vocab_size=640", f"workdir={tmp_path}")
    tasks = agent_family_tasks(6, seed=3, names="fixed")
    with pytest.raises(ConfigError, match="model.tokenizer: bpe, but .* no tokenizer.json"):
        model_tokenizer(cfg)
    reports = []
    fit_tokenizer(cfg, tasks, report=reports.append)
    assert len(reports) == 1 and "bytes a token" in reports[0]
    tok = model_tokenizer(cfg)
    assert isinstance(tok, HFTokenizer) and 259 < tok.vocab_size <= 640
    learnt = (tmp_path / "tokenizer" / "tokenizer.json").stat().st_mtime_ns
    fit_tokenizer(cfg, tasks, report=reports.append)  # a restart keeps the ids it trained with
    assert len(reports) == 1
    assert (tmp_path / "tokenizer" / "tokenizer.json").stat().st_mtime_ns == learnt
    in_bytes = _agent_demonstrations(cfg, TOK, tasks[:2])
    in_bpe = _agent_demonstrations(cfg, tok, tasks[:2])
    for (b, calls_b, _), (t, calls_t, _) in zip(in_bytes, in_bpe, strict=True):
        assert calls_b == calls_t and TOK.decode(b.tokens) == tok.decode(t.tokens)
        assert len(t.tokens) < len(b.tokens) / 2.5
        assert TOK.decode([x for x, m in zip(b.tokens, b.policy_mask) if m]) == tok.decode(
            [x for x, m in zip(t.tokens, t.policy_mask) if m])  # the same actions
    with pytest.raises(ConfigError, match="model.vocab_size: 300, but .* has"):
        model_tokenizer(_cfg("model.tokenizer=bpe", "model.vocab_size=300", f"workdir={tmp_path}"))


def test_fit_tokenizer_without_demonstrations_reads_prompts_and_references(tmp_path):
    cfg = load_config("configs/default.yaml", ["model.tokenizer=bpe", "model.vocab_size=400",
                                               f"workdir={tmp_path}"])
    tasks = synthetic_tasks(40, seed=1)
    fit_tokenizer(cfg, tasks, report=lambda _: None)
    tok = model_tokenizer(cfg)
    text = tasks[0].prompt + tasks[0].metadata["reference"]
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) < len(text) / 2
    fit_tokenizer(_cfg(), tasks, report=pytest.fail)  # bytes: nothing to learn


def test_bpe_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="model.tokenizer: bpe is learnt for a model at random"):
        validate(_cfg("model.tokenizer=bpe", "init_from=/some/checkpoint"))
    with pytest.raises(ConfigError, match="model.vocab_size: must be >= 259"):
        validate(_cfg("model.tokenizer=bpe", "model.vocab_size=200"))
