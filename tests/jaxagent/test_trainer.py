"""End to end: `jaxagent train` on a tiny model, killed with SIGKILL after a checkpoint and
re-run, trains each step exactly once and matches an uninterrupted run (with a KL penalty
against the post-SFT reference, which the checkpoint carries; with LoRA, adapters only)."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxagent.config import ConfigError, apply_overrides, load_config
from jaxagent.metrics import read_metrics

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "sft.steps=3", "sft.batch_size=8", "train.steps=4", "train.prompts_per_step=2",
        "rl.group_size=4", "train.max_new_tokens=8", "tasks.num_train=50", "tasks.num_eval=3",
        "eval.samples=2", "checkpoint.every=1", "rewards.workers=1",
        "sampler.prompt_bucket=64", "sampler.cache_bucket=16"]


def train_cmd(workdir, *extra):
    return [sys.executable, "-m", "jaxagent.cli", "train", *TINY, *extra, f"workdir={workdir}"]


def losses(workdir):
    rows = [r for r in read_metrics(Path(workdir) / "metrics.jsonl") if "train/loss" in r]
    return [(r["step"], r["train/loss"], r["rollout/reward_mean"], r.get("train/kl"))
            for r in rows]


@pytest.mark.parametrize("lora", [(), pytest.param(
    ("model.lora.rank=4", "model.lora.targets=[q_proj, v_proj, down_proj]",
     "model.lora.dropout=0.1"),  # its masks follow the step: the resumed run draws the same
    marks=pytest.mark.slow), pytest.param(
    ("model.lora.rank=4", "model.lora.targets=[q_proj, v_proj]",
     "model.lora.modules_to_save=[embed_tokens]"),  # the tied table trained whole beside
    marks=pytest.mark.slow)], ids=["full", "lora", "lora_saved"])
def test_kill_and_resume_trains_each_step_once(tmp_path, lora):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    # KL against the post-SFT weights (the resumed run must have them too); the entropy bonus
    # moves the policy off them even when every reward of the tiny model is 0
    kl = ("rl.kl_coef=0.5", "rl.entropy_coef=0.05", *lora)
    straight = tmp_path / "straight"
    subprocess.run(train_cmd(straight, *kl), check=True, env=env, capture_output=True)

    run = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(run, *kl), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "2").is_dir():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint 2 appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(train_cmd(run, *kl), check=True, env=env, capture_output=True,
                             text=True)
    assert "Resuming from checkpoint step" in resumed.stderr

    got, want = losses(run), losses(straight)
    assert [s for s, _, _, _ in got] == [1, 2, 3, 4]  # each step exactly once
    assert all(k is not None for *_, k in got) and got[-1][3] > 0  # the KL term is on
    assert got == want  # same rollouts and the same updates as the uninterrupted run
    assert (run / "curves.png").exists() and (run / "config.yaml").exists()
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 4]
    if lora:  # the checkpoint holds the adapters (params, reference, Adam's moments) alone,
        # and the modules trained whole beside them
        saved = ocp.StandardCheckpointer().metadata(run / "checkpoints" / "4" / "state")
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(saved.item_metadata.tree)[0]]
        weights = [p for p in paths if "'count'" not in p]
        whole = {p for p in weights if "['lora']" not in p}
        assert weights and whole == ({f"{tree}['embed']['value']" for tree in (
            "['params']", "['ref_params']", "['opt_state'][1][0]['mu']",
            "['opt_state'][1][0]['nu']")} if "modules_to_save" in lora[-1] else set())


@pytest.mark.parametrize("overrides, message", [
    (["train.micro_batch=5"], "train.micro_batch: must divide the batch"),
    (["rl.group_size=1"], "rl.group_size: must be >= 2"),
    (["rl.negative_scale=-0.5"], "rl.negative_scale: must be >= 0"),
    (["train.logits_chunk_mib=-1"], "train.logits_chunk_mib: must be >= 0"),
    (["eval.k=[1, 8]"], "eval.k: needs eval.samples >= max(k)"),
    (["tasks.source=jsonl"], "tasks.path: required for jsonl"),
    (["tasks.pool.size=-1"], "tasks.pool.size: must be >= 0"),
    (["tasks.pool.size=4", "tasks.pool.retire_after=0"], "tasks.pool.retire_after: must be >= 1"),
    (["tasks.pool.size=4", "rl.algorithm=dapo", "rl.refill_draws=2"],
     "tasks.pool.size: cannot be combined with rl.refill_draws"),
    (["tasks.mix.window=-1"], "tasks.mix.window: must be >= 0"),
    (["tasks.mix.window=4", "tasks.pool.size=4"],
     "tasks.mix.window: cannot be combined with tasks.pool.size"),
    (["tasks.mix.window=4", "rl.algorithm=dapo", "rl.refill_draws=2"],
     "tasks.mix.window: cannot be combined with rl.refill_draws"),
    (["tasks.mix.window=4", "tasks.mix.floor=-0.1"], "tasks.mix.floor: must be in [0, 1)"),
    # conftest: 8 devices
    (["mesh.data=3"], "mesh: mesh.data=3, mesh.fsdp=1, mesh.expert=1, mesh.tensor=1 makes 3 devices"),
    (["sft.batch_size=12"], "sft.batch_size: the global batch (12 rows) does not split over the 8"),
    (["sft.data=documents", "model.attention=nsa"], "sft.data: documents need document attention"),
    (["sft.data=agent"], "sft.data: agent demonstrations need agent.enabled: true"),
    (["sft.copy_steps=-1"], "sft.copy_steps: must be >= 0"),
    (["sft.copy_steps=4"], "sft.copy_steps: needs sft.data: agent and sft.steps > 0"),
    (["sft.redraw_facts=true"], "sft.redraw_facts: needs sft.data: agent over the embedded"),
    (["sft.observation_weight=0.1"], "sft.observation_weight: must be >= 0 and needs sft.data"),
    (["sft.observation_weight=-1", "sft.data=agent"], "sft.observation_weight: must be >= 0"),
    (["sft.recovery=1.5"], "sft.recovery: must be in [0, 1]"),
    (["sft.recovery=-0.1"], "sft.recovery: must be in [0, 1]"),
    (["sft.recovery=0.5"], "sft.recovery: needs sft.data: agent over the embedded"),
    (["sft.valid_tasks=-1"], "sft.valid_tasks: sft.valid_tasks and sft.valid_every must be >= 0"),
    (["sft.valid_tasks=4"], "sft.valid_tasks: needs sft.data: agent over the embedded"),
    (["sft.valid_stop=0.5"], "sft.valid_stop: must be in [0, 1] and needs sft.valid_tasks"),
    (["agent.enabled=true", "sft.data=agent", "sft.copy_steps=4", "sft.copy_batch_size=12"],
     "sft.copy_batch_size: the global batch (12 rows) does not split over the 8"),
    (["agent.enabled=true", "agent.episodes=0"], "agent.episodes: must be >= 1"),
    (["agent.enabled=true", "sft.data=agent", "agent.tools=[read_file, run_tests, finish]"],
     "agent.tools: the warm-up's scripted episodes edit with edit or replace_line"),
    (["rl.overlong_buffer=-1"], "rl.overlong_buffer: must be >= 0"),
    (["agent.enabled=true", "rl.overlong_buffer=4"], "rl.overlong_buffer: is for single completions"),
    (["rl.algorithm=dapo", "rl.drop_zero_variance_groups=false", "rl.refill_draws=2"],
     "rl.refill_draws: needs dynamic sampling"),
    (["model.lora.rank=4", "model.lora.targets=[q_proj, wq]"],
     "model.lora.targets: ['wq'] match no module"),
    (["model.lora.rank=4", "model.lora.dropout=1"], "model.lora.dropout: must be in [0, 1)"),
    (["model.lora.rank=4", "model.lora.targets=[lm_head]"],
     "model.lora.targets: lm_head needs model.tie_embeddings: false"),
])
def test_semantic_config_errors_fail_before_compute(tmp_path, overrides, message):
    from jaxagent.train.loop import train

    with pytest.raises(ConfigError, match=re.escape(message)):
        train(load_config(None, [*overrides, f"workdir={tmp_path}"]))
    assert not (tmp_path / "config.yaml").exists()


def test_logits_chunk_follows_the_loaded_models_vocabulary():
    # An HF checkpoint brings its own vocabulary; cfg.model keeps the YAML's (264 by default).
    from types import SimpleNamespace

    from jaxagent.config import Config, ModelConfig, TrainConfig
    from jaxagent.train.build import logits_chunk

    cfg = Config(train=TrainConfig(logits_chunk_mib=3))
    model = SimpleNamespace(config=ModelConfig(vocab_size=151_936))
    assert logits_chunk(cfg, model) == 3 * 2**20 // (4 * 151_936) == 5
    assert logits_chunk(Config(train=TrainConfig(logits_chunk_mib=0)), model) == 0


def test_bad_config_fails_before_compute(tmp_path):
    with pytest.raises(ConfigError, match="rl.algorithm: 'ppo' is not one of"):
        load_config(None, ["rl.algorithm=ppo"])
    proc = subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", "train.stepz=3",
                           f"workdir={tmp_path}"], capture_output=True, text=True)
    assert proc.returncode == 2 and "train.stepz: unknown key" in proc.stderr
    assert not (tmp_path / "config.yaml").exists()


MOE = ["model.family=qwen3_moe", "model.num_experts=3", "model.num_experts_per_tok=2",
       "model.moe_intermediate_size=24"]


@pytest.mark.parametrize("moe", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["dense", "moe"])
def test_sft_then_eval_cli(tmp_path, capsys, moe):
    from jaxagent.cli import main

    small = [o for o in TINY if not o.startswith(("sft.steps", "checkpoint"))] + (MOE if moe else [])
    assert main(["sft", *small, "sft.steps=2", f"workdir={tmp_path}"]) == 0
    exported = json.loads((tmp_path / "sft" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    assert exported.get("num_experts") == (3 if moe else None)
    out = tmp_path / "eval.jsonl"
    assert main(["eval", "--checkpoint", str(tmp_path / "sft"), "--tasks", "synthetic:3:5",
                 "--k", "1,2", "--samples", "2", "--out", str(out), *small]) == 0
    printed = capsys.readouterr().out
    assert "pass@1:" in printed and "pass@2:" in printed
    rows = [line for line in out.read_text().splitlines() if line]
    assert len(rows) == 6  # 3 tasks x 2 samples


def test_sft_on_documents_cli(tmp_path, capsys):
    """configs/doc_tiny.yaml, shrunk: SFT on the document-retrieval family reports held-out
    answer accuracy before and after (dense attention with the same segment rule: the Pallas
    kernel's equality with it is tested in tests/pallas_kernels)."""
    from jaxagent.cli import main

    small = [o for o in TINY if o.startswith("model.")]
    assert main(["sft", "--config", "configs/doc_tiny.yaml", *small, "model.attention=dense",
                 "sft.steps=2", "sft.batch_size=8", "sft.documents.eval_examples=8",
                 f"workdir={tmp_path}"]) == 0
    metrics = json.loads((tmp_path / "sft" / "sft_metrics.json").read_text())
    assert {"sft/answer_accuracy_start", "sft/answer_accuracy"} <= metrics.keys()
    assert metrics["sft/tokens"] == 8 * 5  # 3 digits, newline, stop token per row
    assert "sft/answer_accuracy" in capsys.readouterr().err


def test_max_staleness_0_reproduces_the_synchronous_loop_exactly(tmp_path):
    """The async code path with k = 0 against the synchronous schedule spelled out by hand:
    sample (sampler.generate), score (score_batch), train, hand the weights over, repeat."""
    from flax import nnx

    from jaxagent.optim import make_optimizer
    from jaxagent.steps import rl_step
    from jaxagent.train.build import (
        load_model_and_tokenizer,
        load_task_splits,
        logits_chunk,
        loss_options,
        make_scorer,
        validate,
    )
    from jaxagent.train.loop import compute_advantages, to_train_batch, train
    from rollouts.producer import Rollout, RolloutBatch
    from rollouts.sampler import Sampler
    from rollouts.tasks import task_dataset

    small = [o for o in TINY if not o.startswith(("sft.steps", "tasks.num_eval", "train.steps"))]
    overrides = [*small, "sft.steps=0", "tasks.num_eval=0", "train.steps=3"]
    cfg = validate(load_config(None, [*overrides, "rollout.max_staleness=0",
                                      f"workdir={tmp_path / 'k0'}"]))
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "k0" / "metrics.jsonl") if "train/loss" in r]
    assert [r["rollout/staleness"] for r in rows] == [0, 0, 0]

    model, tok = load_model_and_tokenizer(cfg)
    graphdef, params = nnx.split(model)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    opt_state = tx.init(params)
    tasks = iter(task_dataset(load_task_splits(cfg)[0], seed=cfg.seed))
    sampler = Sampler(nnx.merge(graphdef, params), tok, prompt_bucket=cfg.sampler.prompt_bucket,
                      cache_bucket=cfg.sampler.cache_bucket,
                      batch_bucket=cfg.sampler.batch_bucket)
    t, g = cfg.train, cfg.rl.group_size
    want = []
    with make_scorer(cfg) as scorer:
        for step in range(t.steps):
            group = [next(tasks) for _ in range(t.prompts_per_step)]
            prompts = [tok.encode(x.prompt) for x in group]
            out = sampler.generate(prompts, num_samples=g, max_new_tokens=t.max_new_tokens,
                                   temperature=t.temperature, stop_token_ids=tok.stop_ids,
                                   seed=cfg.seed * 1_000_003 + step)
            rewards = scorer.score_batch([x for x in group for _ in range(g)],
                                         [tok.decode(c) for c in out.tokens])
            batch = RolloutBatch(step, g, [
                Rollout(r.task_id, prompts[i // g], c, [True] * len(c), [float(x) for x in lp],
                        "", r.reward, r.status, "", step)
                for i, (c, lp, r) in enumerate(zip(out.tokens, out.logprobs, rewards))], {})
            adv, keep = compute_advantages(cfg.rl, batch, t.max_new_tokens)
            reward = float(np.mean([r.reward for r in rewards]))
            if not np.any(adv * keep):  # no gradient: no update (nor Adam's momentum)
                want.append((0.0, None, reward))
                continue
            params, opt_state, m = rl_step(graphdef, tx, params, opt_state,
                                           to_train_batch(batch, adv, keep), None,
                                           options=loss_options(cfg), micro_batch=t.micro_batch,
                                           logits_chunk=logits_chunk(cfg, model))
            sampler.update_weights(params)
            want.append((float(m["train/loss"]), float(m["train/grad_norm"]), reward))
    got = [(r["train/loss"], r.get("train/grad_norm"), r["rollout/reward_mean"]) for r in rows]
    assert got == want


def test_max_staleness_1_trains_on_one_step_old_batches(tmp_path):
    from jaxagent.train.loop import train

    small = [o for o in TINY if not o.startswith(("sft.steps", "tasks.num_eval"))]
    # the entropy term gives every step a gradient, so every step updates (and logs ratios)
    cfg = load_config(None, [*small, "sft.steps=0", "tasks.num_eval=0", "checkpoint.every=1",
                             "rollout.max_staleness=1", "rl.entropy_coef=0.001",
                             f"workdir={tmp_path}"])
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    for r in rows:
        assert 0 <= r["rollout/overlap"] <= 1 and r["time/weight_sync_s"] >= 0
        assert r["train/behaviour_ratio_max"] >= r["train/behaviour_ratio_mean"] > 0
    # The checkpoint after 3 steps holds the batch step 4 trained (sampled with version 2, so
    # a resume from version 3 could not recreate it) and the task state after it.
    manager = ocp.CheckpointManager(tmp_path / "checkpoints", item_names=("state", "extra"))
    extra = manager.restore(3, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))["extra"]
    (queued,) = extra["queued"]
    logged = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert queued["version"] == 2
    assert [r["completion"] for r in queued["rollouts"][:cfg.train.log_rollouts]] == [
        r["completion"] for r in logged if r["step"] == 4]
    assert extra["data"] == {"next_index": 4 * cfg.train.prompts_per_step}


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_infrastructure_failures_are_left_out_of_the_advantages(algorithm):
    from jaxagent.rl.config import RLConfig
    from jaxagent.train.build import expand_algorithm
    from jaxagent.train.loop import compute_advantages
    from rollouts.producer import INFRA_ERROR, Rollout, RolloutBatch

    rewards = [[1.0, 0.0, 0.5, 0.0], [0.25, 1.0, 0.0, 0.75]]
    failed = {(0, 1), (1, 0), (1, 2)}
    batch = RolloutBatch(0, 4, [
        Rollout("t", [1], [2, 3], [True, True], [-1.0, -1.0], "", r,
                INFRA_ERROR if (g, i) in failed else "passed", "stop", 0)
        for g, row in enumerate(rewards) for i, r in enumerate(row)], {})
    adv, keep = compute_advantages(expand_algorithm(RLConfig(algorithm=algorithm, group_size=4)),
                                   batch, 8)

    def reference(r):  # over the group's scored members only, in float64
        r = np.asarray(r)
        if algorithm == "rloo":
            return r - (r.sum() - r) / (len(r) - 1)
        return (r - r.mean()) / (r.std() + 1e-6)

    want = np.zeros((2, 4))
    want[0, [0, 2, 3]] = reference([1.0, 0.5, 0.0])
    want[1, [1, 3]] = reference([1.0, 0.75])
    np.testing.assert_allclose(adv, want.reshape(-1), rtol=1e-5, atol=1e-6)
    assert keep.tolist() == [(g, i) not in failed for g in range(2) for i in range(4)]


def test_step_row_counts_the_groups_whose_rewards_differ():
    from jaxagent.train.loop import step_row
    from rollouts.producer import INFRA_ERROR, Rollout, RolloutBatch

    # signal: differing rewards; none: all equal, or equal over the scored members only
    rewards = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.2, 0.2, 0.7], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    failed = {(3, 1), (4, 2)}
    batch = RolloutBatch(0, 3, [
        Rollout("t", [1], [2], [True], [-1.0], "", r,
                INFRA_ERROR if (g, i) in failed else "passed", "stop", 0)
        for g, row in enumerate(rewards) for i, r in enumerate(row)],
        {"time/generate_s": 1.0, "time/reward_s": 0.0})
    row = step_row(1, batch, {"time/wait_s": 0.0}, {}, np.ones(15, bool), t0=0.0, train_s=0.0,
                   sync_s=0.0)
    assert row["rollout/signal_fraction"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_negative_scale_scales_the_negative_advantages_only(scale):
    """rl.negative_scale on RLOO advantages of fractional rewards, against float64 by hand."""
    from jaxagent.rl.config import RLConfig
    from jaxagent.train.build import expand_algorithm
    from jaxagent.train.loop import compute_advantages
    from rollouts.producer import Rollout, RolloutBatch

    rewards = np.random.default_rng(3).choice([0.0, 0.2, 0.6, 1.0], size=(3, 5))
    rewards[1] = 0.6  # no signal: 0 whatever the scale
    batch = RolloutBatch(0, 5, [Rollout("t", [1], [2], [True], [-1.0], "", r, "passed", "stop", 0)
                                for r in rewards.reshape(-1)], {})
    cfg = expand_algorithm(RLConfig(algorithm="rloo", group_size=5, negative_scale=scale))
    adv, keep = compute_advantages(cfg, batch, 8)
    loo = rewards - (rewards.sum(-1, keepdims=True) - rewards) / 4
    want = np.where(loo < 0, scale * loo, loo).reshape(-1)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert (adv > 0).sum() == (loo > 1e-9).sum() > 0 and keep.all()


def test_validation_expands_the_algorithm_and_an_explicit_key_wins():
    from jaxagent.train.build import loss_options, validate

    def resolved(*overrides):
        return validate(load_config(None, list(overrides)))

    dapo = resolved("rl.algorithm=dapo")
    assert (dapo.rl.clip_low, dapo.rl.clip_high, dapo.rl.drop_zero_variance_groups) == (0.2, 0.28, True)
    assert (loss_options(dapo).clip_low, loss_options(dapo).clip_high) == (0.2, 0.28)
    assert validate(dapo) == dapo  # a saved (resolved) config validates to itself
    # An explicit key wins whether it comes before or after the algorithm; a preset does not
    # stick when a later override changes the algorithm.
    assert resolved("rl.clip_high=0.25", "rl.algorithm=dapo").rl.clip_high == 0.25
    assert resolved("rl.algorithm=dapo", "rl.clip_high=0.25").rl.clip_high == 0.25
    assert resolved("rl.algorithm=rloo", "rl.algorithm=grpo").rl.baseline == "mean"
    dr = loss_options(resolved("rl.algorithm=dr_grpo"))
    assert (dr.aggregation, dr.norm_length) == ("seq-mean-token-sum-norm", 16)
    dr = loss_options(resolved("rl.algorithm=dr_grpo", "rl.aggregation=token-mean"))
    assert (dr.aggregation, dr.norm_length) == ("token-mean", None)
    # Dynamic sampling (which refill_draws needs) from dapo's preset or from the key itself.
    resolved("rl.algorithm=dapo", "rl.refill_draws=2")
    resolved("rl.drop_zero_variance_groups=true", "rl.refill_draws=2")


def test_the_saved_config_holds_the_resolved_settings(tmp_path):
    from jaxagent.models.hf import CheckpointError
    from jaxagent.train.build import validate
    from jaxagent.train.loop import train

    cfg = load_config(None, ["rl.algorithm=dapo", "rl.clip_high=0.3",
                             f"init_from={tmp_path / 'missing'}", f"workdir={tmp_path}"])
    with pytest.raises(CheckpointError):  # after the config is saved, before any compute
        train(cfg)
    saved = load_config(tmp_path / "config.yaml")
    want = dict(algorithm="dapo", baseline="mean", normalize_std=True, clip_low=0.2,
                clip_high=0.3, aggregation="token-mean", drop_zero_variance_groups=True)
    assert {key: getattr(saved.rl, key) for key in want} == want
    assert saved.rl == validate(cfg).rl and None not in dataclasses.asdict(saved.rl).values()
    assert saved.model.attention_backend == "xla"  # `auto` for dense attention


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "dapo"])
def test_overlong_buffer_is_honoured_with_every_algorithm(algorithm):
    from jaxagent.rl.config import RLConfig
    from jaxagent.train.build import expand_algorithm
    from jaxagent.train.loop import compute_advantages
    from rollouts.producer import Rollout, RolloutBatch

    # One group; every completion passes. Of max_new_tokens 8, the last 4 are penalised:
    # lengths 2, 5, 7, 8 get 0, -0.25, -0.75, -1.
    lengths = [2, 5, 7, 8]
    batch = RolloutBatch(0, 4, [Rollout("t", [1], [2] * n, [True] * n, [-1.0] * n, "", 1.0,
                                        "passed", "stop", 0) for n in lengths], {})
    rl_cfg = expand_algorithm(RLConfig(algorithm=algorithm, group_size=4, overlong_buffer=4))
    adv, keep = compute_advantages(rl_cfg, batch, 8)
    r = np.array([1.0, 0.75, 0.25, 0.0])
    want = r - (r.sum() - r) / 3 if algorithm == "rloo" else r - r.mean()
    if algorithm in ("grpo", "dapo"):
        want = want / (r.std() + 1e-6)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert keep.all()  # the penalty gives the group a signal, also for dapo's filter
    adv, keep = compute_advantages(dataclasses.replace(rl_cfg, overlong_buffer=0), batch, 8)
    assert not adv.any() and keep.all() == (algorithm != "dapo")


def test_feedback_batch_holds_the_flagged_turns_with_their_hints():
    from jaxagent.tokenizer import ByteTokenizer
    from jaxagent.train.loop import to_feedback_batch
    from rollouts.agent.feedback import HINTS
    from rollouts.producer import Rollout, RolloutBatch

    tok = ByteTokenizer()
    prompt, completion = list(range(40, 50)), list(range(60, 80))

    def rollout(flagged):
        return Rollout("t", prompt, completion, [True] * 20, [0.0] * 20, "", 0.0, "failed",
                       "stop", 0, flagged=flagged)

    # Turn [12, 17) flagged as a bad call in row 0, turn [25, 30) as a repeat in row 1.
    batch = RolloutBatch(0, 2, [rollout([(12, 17, "bad_tool_call")]),
                                rollout([(25, 30, "repeat")])], {})
    fb = to_feedback_batch(RolloutBatch.from_json(batch.to_json()), tok, rows=4)  # survives JSON
    seq = prompt + completion
    hint = tok.encode("\n" + HINTS["bad_tool_call"] + "\n")
    n = len(hint)
    np.testing.assert_array_equal(fb.student_tokens[0, :17], seq[:17])
    np.testing.assert_array_equal(fb.teacher_tokens[0, :17 + n], seq[:12] + hint + seq[12:17])
    np.testing.assert_array_equal(fb.student_index[0, :5], np.arange(11, 16))
    np.testing.assert_array_equal(fb.teacher_index[0, :5], np.arange(11, 16) + n)
    np.testing.assert_array_equal(np.asarray(fb.mask).sum(-1), [5, 5, 0, 0])
    assert to_feedback_batch(batch, tok, rows=1).mask.sum() == 5  # capped at `rows`
    # a configured hint (agent.feedback_hints) replaces its detector's, the others stay
    mine = {**HINTS, "bad_tool_call": "@run_tests"}
    fb = to_feedback_batch(batch, tok, rows=2, hints=mine)
    calls = tok.encode("\n@run_tests\n")
    np.testing.assert_array_equal(fb.teacher_tokens[0, :17 + len(calls)], seq[:12] + calls + seq[12:17])
    np.testing.assert_array_equal(fb.teacher_index[0, :5], np.arange(11, 16) + len(calls))
    repeat = tok.encode("\n" + HINTS["repeat"] + "\n")
    np.testing.assert_array_equal(fb.teacher_tokens[1, :30 + len(repeat)], seq[:25] + repeat + seq[25:30])
    # the scripted teacher: the context before each turn, then the script's call as targets
    batch.rollouts[0].corrections, batch.rollouts[1].corrections = [[7, 8, 9]], [[5, 6]]
    fb = to_feedback_batch(RolloutBatch.from_json(batch.to_json()), tok, rows=4, teacher="script")
    assert fb.teacher_tokens is None
    np.testing.assert_array_equal(fb.student_tokens[0, :15], seq[:12] + [7, 8, 9])
    np.testing.assert_array_equal(fb.student_tokens[1, :27], seq[:25] + [5, 6])
    np.testing.assert_array_equal(fb.student_index[0, :3], [11, 12, 13])
    np.testing.assert_array_equal(fb.targets[0, :3], [7, 8, 9])
    np.testing.assert_array_equal(fb.targets[1, :2], [5, 6])
    np.testing.assert_array_equal(np.asarray(fb.mask).sum(-1), [3, 2, 0, 0])


def test_grammar_feedback_batch_cuts_each_broken_call_at_its_first_wrong_byte(tmp_path):
    from jaxagent.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
    from jaxagent.models import init_model
    from jaxagent.steps import feedback_term
    from jaxagent.train.build import agent_tools, call_grammar, validate
    from jaxagent.train.loop import to_feedback_batch
    from rollouts.producer import Rollout, RolloutBatch

    tok = ByteTokenizer()
    cfg = load_config("configs/agent_default.yaml", ["agent.feedback_beta=0.1",
                                                     "agent.feedback_detectors=[bad_tool_call]",
                                                     "agent.feedback_teacher=grammar",
                                                     "model.tokenizer=bytes",
                                                     "model.vocab_size=264"])
    grammar = call_grammar(cfg, tok)
    assert sorted(grammar.params) == sorted(t.name for t in agent_tools(cfg))
    prompt = tok.encode("<|assistant|>\n")
    turns = ['@read_file {"pth": "app/core.py"}', '@read_file {"path": "app/nope.py"}',
             '@replace_line {"path": "a", "line": x}']
    completion, spans = [], []
    for text in turns:
        start = len(prompt) + len(completion)
        completion += tok.encode(text) + [tok.eos_id]
        spans.append((start, len(prompt) + len(completion), "bad_tool_call"))
        completion += tok.encode("\nerror\n")
    n = len(completion)
    batch = RolloutBatch(0, 1, [Rollout("t", prompt, completion, [True] * n, [0.0] * n, "", 0.0,
                                        "failed", "stop", 0, flagged=spans)], {})
    fb = to_feedback_batch(RolloutBatch.from_json(batch.to_json()), tok, rows=4, teacher="grammar",
                           grammar=grammar)
    # the second call is well-formed (its path is wrong, not its bytes): no row
    np.testing.assert_array_equal(np.asarray(fb.mask).sum(-1), [15, 37, 0, 0])
    seq = prompt + completion
    first, third = spans[0][0], spans[2][0]
    np.testing.assert_array_equal(fb.student_tokens[0, :first + 15], seq[:first + 15])
    assert not np.asarray(fb.student_tokens[0, first + 15:]).any()
    np.testing.assert_array_equal(fb.student_index[1, :37], np.arange(third - 1, third + 36))
    assert tok.decode(fb.targets[1, :37]) == '@replace_line {"path": "a", "line": x'
    assert np.flatnonzero(fb.allowed[0, 14]).tolist() == [ord("a")]  # '"p' then "a" (path)
    assert not fb.allowed[1, 36, ord("x")] and fb.allowed[1, 36, ord("7")]
    assert fb.allowed[0, 15:].all()  # past the cut: everything (and mask 0)
    # the model's vocabulary (264) is padded past the tokenizer's (259): those are refused
    model = init_model(dataclasses.replace(cfg.model, num_layers=1), seed=0)
    assert model.config.vocab_size > tok.vocab_size == fb.allowed.shape[-1]
    assert 0 < float(feedback_term(model, fb, beta=1.0)) < 20
    with pytest.raises(ConfigError, match="agent.feedback_teacher: grammar reads calls in"):
        validate(apply_overrides(cfg, ["agent.call_format=hermes"]))
    # a byte-level BPE's tokens are byte strings; SentencePiece's "▁" pieces are not
    bpe = train_bpe(['@read_file {"path": "app/core.py"}'], 300, tmp_path / "bpe")
    assert call_grammar(cfg, bpe).token_bytes == bpe.token_bytes()
    from tokenizers import Tokenizer, decoders, models
    spm = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581a": 1}, unk_token="<unk>"))
    spm.decoder = decoders.Metaspace()
    (tmp_path / "spm").mkdir()
    spm.save(str(tmp_path / "spm" / "tokenizer.json"))
    with pytest.raises(ConfigError, match="grammar reads calls byte by byte.*spm/tokenizer.json: "
                                          "not a byte-level BPE"):
        call_grammar(cfg, HFTokenizer(tmp_path / "spm"))


@pytest.mark.slow
def test_family_mix_logs_its_shares_and_resumes_from_its_checkpoint(tmp_path):
    """The synthetic families drawn by their signal (tasks.mix): the shares are logged each
    step and sum to 1, a run resumed after checkpoint 2 logs what the uninterrupted run did
    (the mix's state, its families' recent groups, is in the checkpoint), and one starts from
    the warm-up checkpoint of a run without the mix."""
    import shutil

    from jaxagent.train.loop import train

    small = [o for o in TINY if not o.startswith(("tasks.num_eval", "train.steps"))]
    overrides = [*small, "tasks.num_eval=1", "train.steps=4", "tasks.mix.window=2",
                 "rollout.max_staleness=1"]
    run = tmp_path / "run"
    train(load_config(None, [*overrides, f"workdir={run}"]))

    def logged():
        return {r["step"]: (r["train/loss"], r["rollout/reward_mean"],
                            {k: v for k, v in r.items() if k.startswith("tasks/")})
                for r in read_metrics(run / "metrics.jsonl") if "train/loss" in r}

    straight = logged()
    assert sorted(straight) == [1, 2, 3, 4]
    for _, _, mix in straight.values():
        shares = [v for k, v in mix.items() if k.startswith("tasks/share/")]
        assert len(shares) > 1 and sum(shares) == pytest.approx(1.0)
    assert any(k.startswith("tasks/signal/") for k in straight[4][2])
    for lost in ("3", "4"):
        shutil.rmtree(run / "checkpoints" / lost)
    train(load_config(None, [*overrides, f"workdir={run}"]))
    assert logged() == straight
    # RL from the warm-up checkpoint (step 0) of a run without the mix, as
    # benchmarks/agent_learning.py --warmup starts one: its stream had drawn nothing
    plain = tmp_path / "plain"
    train(load_config(None, [*small, "tasks.num_eval=1", "train.steps=1", f"workdir={plain}"]))
    shutil.rmtree(run)
    shutil.copytree(plain / "checkpoints" / "0", run / "checkpoints" / "0")
    train(load_config(None, [*overrides, f"workdir={run}"]))
    assert sorted(logged()) == [1, 2, 3, 4]


@pytest.mark.slow
def test_task_pool_retires_solved_tasks_and_resumes_from_its_checkpoint(tmp_path):
    """Tasks any completion solves (it lands in a comment) retire from a pool of 2, and a run
    resumed after checkpoint 2 (the later ones lost, as a kill leaves it) logs what the
    uninterrupted run did: the pool's state is in the checkpoint."""
    import shutil

    from jaxagent.train.loop import train

    lines = [{"task_id": f"easy{i}", "prompt": f"def f():\n    return {i}\n#",
              "entry_point": "f", "tests": [f"assert f() == {i}"], "completion_mode": "continue"}
             for i in range(6)]
    lines += [{"task_id": f"hard{i}", "prompt": "def f():\n", "entry_point": "f",
               "tests": ["assert f() == 'never'"], "completion_mode": "continue"} for i in range(2)]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    small = [o for o in TINY if not o.startswith(("sft.steps", "tasks.num_eval", "train.steps"))]
    overrides = [*small, "sft.steps=0", "tasks.num_eval=1", "train.steps=4", "tasks.source=jsonl",
                 f"tasks.path={path}", "tasks.pool.size=2", "tasks.pool.retire_after=1",
                 "rollout.max_staleness=1"]
    run = tmp_path / "run"
    train(load_config(None, [*overrides, f"workdir={run}"]))

    def logged():
        return {r["step"]: (r["train/loss"], r["rollout/pass_rate"], r["tasks/retired"],
                            r["tasks/pool_size"], r["tasks/unseen"])
                for r in read_metrics(run / "metrics.jsonl") if "train/loss" in r}

    straight = logged()
    assert sorted(straight) == [1, 2, 3, 4]
    assert straight[4][2] >= 1 and {row[3] for row in straight.values()} == {2}
    for lost in ("3", "4"):
        shutil.rmtree(run / "checkpoints" / lost)
    train(load_config(None, [*overrides, f"workdir={run}"]))
    assert logged() == straight
