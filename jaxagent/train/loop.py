"""The RL loop, top to bottom: set up, restore or warm up (SFT), then per step: batch, update,
log, checkpoint.

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
the next k steps will train; with LoRA the params are the adapters and the base is loaded
again) and trains each remaining step exactly once. Sampling seeds derive from (seed, step)
and each batch's weights version from its step, so a resumed run reproduces an uninterrupted
one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from contextlib import closing, nullcontext
from pathlib import Path
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from rich.console import Console
from rich.progress import Progress

from jaxagent import rl
from jaxagent.checkpoint import Checkpointer
from jaxagent.config import Config, save_config
from jaxagent.metrics import MetricsWriter, plot_curves, trim_jsonl
from jaxagent.models import sees_all_segments
from jaxagent.models.adapters import split_trainable
from jaxagent.models.lora import dropout_key
from jaxagent.optim import make_optimizer
from jaxagent.rl.config import RLConfig
from jaxagent.steps import (FeedbackBatch, LossOptions, TrainBatch, pack, pack_budget,
                            pack_feedback, pack_shared, policy_logprobs, ppo_update,
                            split_rows)
from jaxagent.train.build import (call_grammar, load_model_and_tokenizer, logits_chunk,
                                  loss_options, make_producer, make_progress, make_sampler,
                                  make_scorer, resolve_attention, rl_layout, run_tasks,
                                  task_pool, task_stream, validate)
from jaxagent.train.evaluate import agent_held_out, held_out_pass_at_k
from jaxagent.train.sft import fit_tokenizer, sft, warmup_log
from jaxagent.train.sync import SamplerWeights
from jaxagent.workdir import check_resume_config, workdir_lock
from rollouts.agent.feedback import HINTS, correction_examples, grammar_examples, turn_examples
from rollouts.agent.grammar import CallGrammar
from rollouts.orchestrator import Orchestrator
from rollouts.producer import RolloutBatch
from rollouts.rewards import Scorer
from rollouts.sampler import Sampler
from rollouts.tasks import Task
from rollouts.tasks.pool import BatchReports, TaskPool
from sharding.distributed import is_leader
from sharding.layout import Layout

# curves.png's panels for agent runs: held-out pass@1 (and by template), the training pass rate,
# turns, malformed calls and the tool mix over steps
AGENT_CURVES = ("eval/pass@1", "eval/agent/pass_rate/*", "rollout/pass_rate",
                "agent/turns_mean", "agent/bad_tool_calls", "agent/tool_calls/*")


def train(cfg: Config, console: Console | None = None, *, task_iter=None) -> dict:
    """RL (after the SFT warm-up) as configured, one run per workdir (a second refuses at once,
    naming the holder). `task_iter`: the training tasks, an iterator with get_state/set_state
    (default: grain over the config's training split)."""
    cfg = validate(cfg)
    layout = rl_layout(cfg)
    cfg = resolve_attention(cfg)  # asks JAX for the platform: after rl_layout starts it
    console = console or Console(stderr=True)
    with workdir_lock(cfg.workdir, jax.process_index(), jax.process_count(), console.print):
        try:
            return run_rl(cfg, layout, console, task_iter)
        except KeyboardInterrupt:
            step = Checkpointer(Path(cfg.workdir) / "checkpoints").latest_step()
            # No checkpoint here: the queued batches are consistent only at a checkpoint's
            # step boundary, and the interrupted step may have taken its batch already.
            console.print(f"interrupted: a rerun resumes from checkpoint step {step} and trains "
                          "the steps after it again" if step is not None
                          else "interrupted before the first checkpoint: a rerun starts afresh")
            raise


def run_rl(cfg: Config, layout: Layout, console: Console, task_iter) -> dict:
    # Set up: the resolved config (checked against a checkpoint's, then saved with the run), the
    # model and its update, the tasks.
    workdir, t = Path(cfg.workdir), cfg.train
    check_resume_config(cfg, workdir)
    save_config(cfg, workdir / "config.yaml")
    train_tasks, eval_tasks = run_tasks(cfg)
    fit_tokenizer(cfg, train_tasks, report=console.print)  # model.tokenizer: bpe
    model, tokenizer = load_model_and_tokenizer(cfg, layout=layout)
    learner, state = Learner.create(cfg, model, tokenizer, layout)
    # the pool that retires solved tasks (tasks.pool) or the family mix (tasks.mix), fed each
    # batch's outcomes below
    pool = task_pool(cfg, train_tasks) if task_iter is None else None
    task_iter = task_stream(cfg, train_tasks, pool) if task_iter is None else task_iter
    ckpt = Checkpointer(workdir / "checkpoints", keep=cfg.checkpoint.keep)
    # The newest checkpoint that restores (a damaged one is set aside, never deleted).
    resumed = ckpt.restore_newest(state.arrays(), report=console.print)
    start = resumed[0] if resumed else None
    trim_jsonl(workdir / "rollouts.jsonl", start)
    with (closing(ckpt), make_scorer(cfg) as scorer,
          closing(MetricsWriter(workdir, resume_step=start, enabled=is_leader())) as metrics,
          make_progress(console) as progress,
          (workdir / "rollouts.jsonl").open("a") as rollouts_file):
        log = Log(metrics, rollouts_file, console, progress, t.log_rollouts)
        # Restore the newest checkpoint, or warm up (SFT).
        if resumed:
            state, queued = restored(state, *resumed[1:], task_iter)
            console.print(f"Resuming from checkpoint step {start} in {ckpt.directory}")
        else:
            start, queued = 0, []
            state = warm_up(cfg, learner, state, train_tasks, progress, metrics)
        # The producer thread's sampler, and one for evaluation in this thread.
        to_sampler = SamplerWeights.create(model.config, layout, learner.graphdef, state.frozen)
        sampler, eval_sampler = (make_sampler(to_sampler.model(state.params), tokenizer, cfg,
                                              layout.sampler_activations)
                                 for _ in range(2))
        evaluate = HeldOutEval(cfg, to_sampler, eval_sampler, tokenizer, scorer, eval_tasks, log)
        if not resumed:  # evaluate, then save step 0: a kill between them repeats the evaluation
            if eval_tasks:
                evaluate(0, state.params)
            ckpt.save(0, state.arrays(), {"step": 0, "data": task_iter.get_state()})
        producer = make_producer(cfg, sampler, tokenizer, scorer, task_iter)
        weights = to_sampler.store(state.params, sampler.params)
        weights.publish(start, state.params)
        bar = progress.add_task("rl", total=t.steps, completed=start, info="")
        with Orchestrator(producer, weights, max_staleness=cfg.rollout.max_staleness,
                          start=start, stop=t.steps, queued=queued,
                          before_draw=pool.apply if pool else None) as orchestrator:
            for step in range(start, t.steps):
                # Batch: scored rollouts, sampled with the weights of step - max_staleness.
                # The pool hears how its tasks did before the weights trained on them are
                # published (the draw that samples with them applies it).
                t0 = time.perf_counter()
                batch, timing = orchestrator.get(step)
                if pool is not None:
                    pool.record(step, pool_outcomes(batch, pool, shared=not cfg.agent.enabled))
                # Update: advantages, then clipped policy-gradient steps; publish the weights
                # (the sampler switches to them before its next batch).
                with profiled(workdir / "profile", step + 1 in t.profile_steps):
                    rows, feedback, keep, signal = learner.prepare(batch, state)
                    state, update_metrics, train_s = learner.update(state, rows, feedback, step,
                                                                    signal=signal)
                done = step + 1
                sync_s = weights.publish(done, state.params) if done < t.steps else 0.0
                # Log: metrics, a few rollouts, progress; evaluate every eval.every steps.
                log.step(done, batch, step_row(step, batch, timing, update_metrics, keep, t0=t0,
                                               train_s=train_s, sync_s=sync_s), bar)
                if cfg.eval.every and done % cfg.eval.every == 0 and done < t.steps:
                    evaluate(done, state.params)
                # Checkpoint: the state, and the batches the next k steps train.
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < t.steps:
                    ckpt.save(done, state.arrays(), {"step": done, **orchestrator.snapshot(done)})
            if start < t.steps:  # evaluate, then save the last step (as at step 0)
                if eval_tasks:
                    evaluate(t.steps, state.params)
                ckpt.save(t.steps, state.arrays(), {"step": t.steps,
                                                    **orchestrator.snapshot(t.steps)})
    if is_leader():
        plot_curves(workdir / "metrics.jsonl", workdir / "curves.png",
                    *([AGENT_CURVES] if cfg.agent.enabled else []))
    return log.summary


# ---------------------------------------------------------------------------------------------
# The loop's parts.


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What the updates change, and what a checkpoint holds."""

    params: Any  # what trains: every weight, or with LoRA the adapters
    opt_state: Any
    ref_params: Any = None  # the KL penalty's frozen reference (the post-SFT weights), if on
    frozen: Any = None  # LoRA: the base weights; fixed, so never checkpointed (loaded again)

    def arrays(self) -> dict:
        ref = {} if self.ref_params is None else {"ref_params": self.ref_params}
        return {"params": self.params, "opt_state": self.opt_state, **ref}


def kl_reference(cfg: Config, params):
    """A frozen copy of `params` when the KL penalty is on, else None (a copy: the train step
    donates params). With LoRA a copy of the adapters only: the reference runs them over the
    same frozen base (the base itself before any update, B = 0)."""
    return jax.tree.map(jnp.copy, params) if cfg.rl.kl_coef else None


@dataclasses.dataclass(frozen=True)
class Learner:
    """How a batch of scored rollouts becomes new weights: what stays fixed through a run."""

    cfg: Config
    graphdef: Any
    tx: Any  # the optax optimizer
    layout: Layout
    tokenizer: Any
    options: LossOptions
    chunk: int  # tokens per LM-head chunk (`logits_chunk`)
    # One row per group with its prompt computed once (`pack_shared`). Agent rows pack too: a
    # group's episodes share the prompt, and each completion's mask (actions only) travels
    # with its tokens.
    share_prompt: bool
    grammar: CallGrammar | None  # the grammar teacher's automaton (`call_grammar`)

    @classmethod
    def create(cls, cfg: Config, model, tokenizer, layout: Layout) -> tuple[Learner, TrainState]:
        """(the learner, the initial state) for `model` laid out on `layout`."""
        graphdef, weights = layout.split(model)
        params, frozen = split_trainable(weights)
        tx = make_optimizer(cfg.optim, cfg.train.steps)
        share = cfg.train.share_prompt and sees_all_segments(cfg.model)
        learner = cls(cfg, graphdef, tx, layout, tokenizer, loss_options(cfg),
                      logits_chunk(cfg, model), share, call_grammar(cfg, tokenizer))
        return learner, TrainState(params, layout.place(tx.init(params)),
                                   kl_reference(cfg, params), frozen)

    def prepare(self, batch: RolloutBatch, state: TrainState | None = None) -> tuple[
            TrainBatch, FeedbackBatch | None, np.ndarray, bool]:
        """(the packed rows with their advantages, the feedback KL's flagged turns if it is
        on, the per-rollout keep mask, whether the update's loss has a gradient at all:
        `carries_signal`). A guided rollout's (a scripted demonstration, `agent.guidance`)
        behaviour log-probs are those of `state`, the weights the update starts from: its
        tokens are weighed as if that policy had sampled them."""
        cfg = self.cfg
        advantages, keep = compute_advantages(cfg.rl, batch, cfg.train.max_new_tokens)
        t = cfg.train

        def packed(b: RolloutBatch) -> TrainBatch:
            return to_train_batch(b, advantages, keep, share_prompt=self.share_prompt,
                                  pack_tokens=t.pack_tokens, parts=cfg.rl.mini_batches,
                                  row_multiple=math.lcm(t.micro_batch or 1, PACKED_ROW_BUCKET,
                                                        self.layout.data_parallel))

        rows = packed(batch)
        if any(r.guided for r in batch.rollouts):
            if state is None:
                raise ValueError("a batch with guided rollouts needs the state it updates")
            rows = self.on_policy(rows, packed(guided_marks(batch)).sampler_logprobs, state)
        # a flagged turn's context is at most its episode, which fits a row unless the rows
        # hold a group's shared prompt and all its episodes (then sized by the flagged turns)
        feedback = (to_feedback_batch(batch, self.tokenizer, cfg.agent.feedback_max_examples,
                                      {**HINTS, **cfg.agent.feedback_hints},
                                      teacher=cfg.agent.feedback_teacher, grammar=self.grammar,
                                      length=0 if self.share_prompt else rows.tokens.shape[1] + 1)
                    if self.options.feedback_beta else None)
        signal = self.carries_signal(rows, feedback)
        if feedback is not None:
            feedback = self.layout.batch(feedback, "the feedback batch")
        return rows, feedback, keep, signal

    def on_policy(self, rows: TrainBatch, marks, state: TrainState) -> TrainBatch:
        """`rows` with the behaviour log-probs where `marks` is 1 taken from `state`'s policy
        (under the sampling distribution, as the loss takes its own)."""
        with self.layout.activations():
            logp = policy_logprobs(self.graphdef, state.params, self.layout.batch(rows),
                                   state.frozen, micro_batch=self.cfg.train.micro_batch,
                                   logits_chunk=self.chunk, sampling=self.options.sampling)
        behaviour = np.where(np.asarray(marks) > 0, np.asarray(logp),
                             np.asarray(rows.sampler_logprobs))
        return dataclasses.replace(rows, sampler_logprobs=jnp.asarray(behaviour))

    def carries_signal(self, rows: TrainBatch, feedback: FeedbackBatch | None) -> bool:
        """Whether the loss on these (host) rows has a gradient: a kept token with a non-zero
        advantage, or a term that does not hinge on the advantages (the KL to the reference,
        the entropy bonus, the router's load-balancing loss, flagged turns for the feedback
        KL). Decided over every process's rows, so all of them skip or none."""
        o, model = self.options, self.cfg.model
        advantages = np.asarray(rows.advantages)  # [B], or [B, T] per token in packed rows
        advantaged = (np.asarray(rows.loss_mask) > 0) & (
            advantages.reshape(len(advantages), -1) != 0)
        local = bool(advantaged.any() or o.kl_coef or o.entropy_coef
                     or (model.num_experts and model.router_aux_loss_coef)
                     or (feedback is not None and np.asarray(feedback.mask).any()))
        if jax.process_count() == 1:
            return local
        return bool(np.asarray(multihost_utils.process_allgather(np.asarray(local))).any())

    def update(self, state: TrainState, rows: TrainBatch, feedback: FeedbackBatch | None,
               step: int, *, signal: bool = True) -> tuple[TrainState, dict, float]:
        """`rl.ppo_epochs` passes of clipped steps over `rl.mini_batches` of the rows (the
        update of step `step`: its LoRA dropout masks) -> (the new state, the update's
        metrics, its seconds). Without `signal` (`carries_signal`) the state is kept as it is:
        on a zero gradient Adam would still move every weight by its momentum (and weight
        decay), so the update is skipped, the optimizer's moments and step count included;
        the loss is then exactly 0."""
        t0 = time.perf_counter()
        if not signal:
            return state, {"train/loss": 0.0, "train/skipped_update": 1.0}, 0.0
        minis = [self.layout.batch(b) for b in split_rows(rows, self.cfg.rl.mini_batches)]
        with self.layout.activations():
            params, opt_state, metrics = ppo_update(
                self.graphdef, self.tx, state.params, state.opt_state, minis, state.ref_params,
                feedback, state.frozen, options=self.options, epochs=self.cfg.rl.ppo_epochs,
                micro_batch=self.cfg.train.micro_batch, logits_chunk=self.chunk,
                dropout_key=dropout_key(self.cfg.model.lora, self.cfg.seed, 1, step))
        # waits for the update
        metrics = {**{k: float(v) for k, v in metrics.items()}, "train/skipped_update": 0.0}
        return (dataclasses.replace(state, params=params, opt_state=opt_state), metrics,
                time.perf_counter() - t0)


def warm_up(cfg: Config, learner: Learner, state: TrainState, train_tasks, progress: Progress,
            metrics: MetricsWriter) -> TrainState:
    """`sft.steps` of SFT (if any; its curves in `workdir/warmup`); the KL reference is then
    the fine-tuned weights."""
    if not cfg.sft.steps:
        return state
    with warmup_log(cfg.workdir) as log:
        params, sft_metrics = sft(cfg, learner.graphdef, state.params, learner.tokenizer,
                                  train_tasks, learner.layout, progress, chunk=learner.chunk,
                                  frozen=state.frozen, log=log)
    metrics.write(0, sft_metrics)
    return dataclasses.replace(state, params=params, ref_params=kl_reference(cfg, params))


def restored(state: TrainState, arrays: dict, extra: dict,
             task_iter) -> tuple[TrainState, list[RolloutBatch]]:
    """(`state` as a checkpoint saved it, the scored batches queued then); the task iterator
    is put back where it was. At step 0 (the warm-up's checkpoint) the stream has drawn
    nothing, so it starts afresh: RL may start from another run's warm-up whose task stream
    was another kind (`tasks.pool`, `tasks.mix`)."""
    if extra["step"]:
        task_iter.set_state(extra["data"])
    return (dataclasses.replace(state, params=arrays["params"], opt_state=arrays["opt_state"],
                                ref_params=arrays.get("ref_params")),
            [RolloutBatch.from_json(b) for b in extra.get("queued", [])])


def pool_outcomes(batch: RolloutBatch, pool: BatchReports,
                  shared: bool) -> list[tuple[str, bool]]:
    """Per group of `batch`, (task id, solved by every rollout of its group) for a task pool,
    (task id, its rewards differ) for a family mix; with `shared` (one global task stream, one
    pool in every process) the groups of every process, in process order, so every process's
    pool hears the same."""
    local = batch.group_outcomes() if isinstance(pool, TaskPool) else batch.group_signals()
    if not shared or jax.process_count() == 1:
        return local
    rows = np.asarray([[pool.index_of(task), value] for task, value in local], np.int32)
    every = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, 2)
    return [(pool.tasks[i].id, bool(value)) for i, value in every]


def profiled(folder: Path, on: bool):
    """A `jax.profiler` trace of the block into `folder` (TensorBoard's profile plugin and
    Perfetto read it) when `on`."""
    return jax.profiler.trace(str(folder)) if on else nullcontext()


def step_row(step: int, batch: RolloutBatch, timing: dict, update_metrics: dict,
             keep: np.ndarray, *, t0: float, train_s: float, sync_s: float) -> dict:
    """A step's metrics row: the batch's, the update's and the schedule's."""
    sampling_s = batch.stats["time/generate_s"] + batch.stats["time/reward_s"]
    return {**batch.stats, **update_metrics, **timing,
            "rollout/kept_fraction": float(keep.mean()),
            # Share of the groups whose rewards differ: the only ones with an advantage.
            "rollout/signal_fraction": float(np.mean(rl.group_has_signal(batch.rewards(),
                                                                         batch.valid()))),
            "rollout/staleness": step - batch.version,
            # Share of this batch's sampling and scoring the trainer did not wait for.
            "rollout/overlap": 1 - min(1.0, timing["time/wait_s"] / max(sampling_s, 1e-9)),
            "time/train_s": train_s, "time/weight_sync_s": sync_s,
            "time/step_s": time.perf_counter() - t0}


@dataclasses.dataclass(frozen=True)
class HeldOutEval:
    """pass@k of given weights on the held-out tasks (`cfg.eval`), logged at a step (agent
    runs: episodes, with their agent/... metrics)."""

    cfg: Config
    to_sampler: SamplerWeights
    sampler: Sampler  # its own, in the trainer's thread
    tokenizer: Any
    scorer: Scorer
    tasks: list[Task]
    log: Log

    def __call__(self, step: int, params) -> None:
        self.sampler.update_weights(self.to_sampler.weights(params))
        args = (self.cfg, self.sampler, self.tokenizer, self.scorer, self.tasks)
        # agent runs play episodes on their held-out repository tasks (minutes: a progress bar)
        self.log.evaluation(step, agent_held_out(*args, progress=self.log.progress)
                            if self.cfg.agent.enabled else held_out_pass_at_k(*args))


@dataclasses.dataclass
class Log:
    """Where a run's numbers go: metrics.jsonl (and TensorBoard), rollouts.jsonl (each
    batch's first `log_rollouts`), the console and progress bar, and the summary `train`
    returns."""

    metrics: MetricsWriter
    rollouts: TextIO
    console: Console
    progress: Progress
    log_rollouts: int
    summary: dict = dataclasses.field(default_factory=dict)

    def evaluation(self, step: int, scores: dict) -> None:
        self.metrics.write(step, scores)
        self.summary.setdefault("eval", {})[step] = scores
        self.console.print(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))

    def step(self, step: int, batch: RolloutBatch, row: dict, bar) -> None:
        self.metrics.write(step, row)
        for r in batch.rollouts[:self.log_rollouts]:
            self.rollouts.write(json.dumps({"step": step, **r.to_json()}) + "\n")
        self.rollouts.flush()
        self.progress.update(bar, advance=1, info=(
            f"reward {row['rollout/reward_mean']:.3f}  "
            f"pass {row['rollout/pass_rate']:.2f}  loss {row['train/loss']:+.4f}"))
        self.summary["last"] = row


# ---------------------------------------------------------------------------------------------
# From scored rollouts to training rows.


def compute_advantages(r: RLConfig, batch: RolloutBatch, max_new_tokens: int):
    """Per-rollout advantages [B] and a keep mask [B], for a validated `rl` config.

    A rollout whose environment failed (infrastructure, not the policy) has no reward: it is
    masked out, and its group's advantages are computed over the group's other members. With
    `rl.drop_zero_variance_groups` (DAPO's dynamic sampling) a group without signal is dropped;
    with `rl.overlong_buffer`, long completions are penalised first (DAPO's overlong shaping);
    `rl.negative_scale` scales the negative advantages last.
    """
    rewards, valid = batch.rewards(), batch.valid()
    if r.overlong_buffer:
        lengths = np.asarray([len(x.completion) for x in batch.rollouts]).reshape(rewards.shape)
        rewards = rewards + np.asarray(rl.overlong_penalty(
            lengths, max_len=max_new_tokens, buffer_len=r.overlong_buffer,
            penalty=r.overlong_penalty))
    advantages = rl.masked_advantages(rewards, valid, baseline=r.baseline,
                                      normalize_std=r.normalize_std)
    if r.negative_scale != 1:
        advantages = rl.scale_negatives(advantages, r.negative_scale)
    keep = (np.asarray(rl.group_has_signal(rewards, valid)) if r.drop_zero_variance_groups
            else np.ones(len(rewards), bool))
    return np.asarray(advantages).reshape(-1), np.repeat(keep, batch.group_size) & valid.reshape(-1)


# Packed rows (`train.pack_tokens`): their number per mini-batch is rounded up to a multiple of
# this (and of train.micro_batch and the data-parallel devices, so that rows split over them
# rather than replicate) with empty rows. Each distinct number of rows compiles the
# update once more (minutes for a real model); the price: a few empty rows, no loss on them.
PACKED_ROW_BUCKET = 2


def to_train_batch(batch: RolloutBatch, advantages: np.ndarray, keep: np.ndarray, *,
                   share_prompt: bool = False, pack_tokens: int = 0, parts: int = 1,
                   row_multiple: int = 1) -> TrainBatch:
    """Pack a rollout batch; dropped groups stay in the batch (fixed shapes) with no loss.
    With `share_prompt`, each group's prompt is one row's prefix (see `pack_shared`); with
    `pack_tokens`, rows of that many tokens hold several rollouts (`pack_budget`: each of the
    `parts` mini-batches of `split_rows` packed apart, in a multiple of `row_multiple` rows)."""
    rows = batch.rollouts
    masks = [[float(k and m) for m in r.policy_mask] for r, k in zip(rows, keep)]
    if parts == 1:
        # rollouts (whole groups when they share a prompt) with a gradient first: the update
        # does not run the micro-batches without one (`rl_step`); the loss is a sum, so the
        # order is free (not with several mini-batches, which it would change)
        has = np.asarray([a != 0 and any(m) for a, m in zip(advantages, masks)])
        unit = batch.group_size if share_prompt else 1
        first = np.argsort(~has.reshape(-1, unit).any(1), kind="stable")
        order = (first[:, None] * unit + np.arange(unit)).reshape(-1)
        rows, masks = [rows[i] for i in order], [masks[i] for i in order]
        advantages = np.asarray(advantages)[order]
    args = ([r.prompt for r in rows], [r.completion for r in rows], [r.logprobs for r in rows],
            advantages)
    if share_prompt:
        return pack_shared(*args, group_size=batch.group_size, completion_masks=masks)
    if pack_tokens:
        return pack_budget(*args, budget=pack_tokens, parts=parts, row_multiple=row_multiple,
                           completion_masks=masks)
    return pack(*args, completion_masks=masks)


def guided_marks(batch: RolloutBatch) -> RolloutBatch:
    """`batch` with each rollout's log-probs replaced by 1 where it is guided (a scripted
    demonstration), else 0: packed as the batch is, its `sampler_logprobs` mark the guided
    tokens."""
    return dataclasses.replace(batch, rollouts=[
        dataclasses.replace(r, logprobs=[float(r.guided)] * len(r.completion))
        for r in batch.rollouts])


def to_feedback_batch(batch: RolloutBatch, tokenizer, rows: int, hints=HINTS, *,
                      teacher: str = "hint", grammar: CallGrammar | None = None,
                      length: int = 0) -> FeedbackBatch:
    """The first `rows` flagged turns of the batch (`Rollout.flagged`) as a FeedbackBatch of
    exactly `rows` rows, by `teacher` (rollouts.agent.feedback): "hint", each with its hinted
    teacher context (`hints`: detector -> text); "script", with the script's call in place of
    the turn (`Rollout.corrections`); "grammar", the turns that leave `grammar`, each up to
    its first refused token, with the tokens allowed along it. Rows are at least `length`
    tokens (`pack_feedback`)."""
    def examples_of(r):
        tokens = r.prompt + r.completion
        if teacher == "script":
            return correction_examples(tokens, r.flagged, r.corrections)
        if teacher == "grammar":
            return grammar_examples(tokens, r.flagged, grammar, tokenizer.stop_ids,
                                    tokenizer.vocab_size)
        return turn_examples(tokens, r.flagged, tokenizer, hints)

    if teacher not in ("hint", "script", "grammar"):
        raise ValueError(f"unknown feedback teacher {teacher!r}; choose hint, script or grammar")
    examples = [e for r in batch.rollouts for e in examples_of(r)][:rows]
    return pack_feedback([(e.student_tokens, e.teacher_tokens, e.student_index, e.teacher_index)
                          for e in examples], rows=rows, teacher_rows=teacher == "hint",
                         allowed=[e.allowed for e in examples] if teacher == "grammar" else None,
                         length=length, vocab_size=tokenizer.vocab_size)
