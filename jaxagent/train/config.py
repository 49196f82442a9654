"""The sections only the trainer reads: `optim`, `train`, `rollout`, `sft`, `checkpoint`,
`eval` (composed into the root `Config` by jaxagent/config.py). Light on purpose: loading a
config imports this module, not the training code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 5e-4  # right for the tiny default; pretrained models want ~1e-6
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"  # after warmup
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # global-norm clipping; 0 disables
    # LoRA+ (arXiv 2402.12354): each adapter's B factor learns at this times the learning rate
    # (A and every other weight at the learning rate itself); 1 is plain LoRA.
    lora_plus_ratio: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    prompts_per_step: int = 16  # groups per step; the batch is prompts_per_step * group_size
    micro_batch: int = 0  # sequences per gradient-accumulation micro-batch; 0 = whole batch
    # The loss runs the LM head on chunks of tokens whose float32 logits take at most this
    # many MiB (each chunk rematerialised in the backward pass, so the [tokens, vocab] logits
    # never exist whole: 10 GiB for 16k tokens of a 152k vocabulary); 0 = no chunks.
    logits_chunk_mib: int = 1024
    max_new_tokens: int = 16
    temperature: float = 1.0
    log_rollouts: int = 4  # rollouts per step written to rollouts.jsonl
    profile_steps: tuple[int, ...] = ()  # steps whose update is traced into WORKDIR/profile
    # Pack each group as one row [prompt, completion_1..G] so the prompt is computed once
    # per group (same loss and gradients); ignored if the attention backend lacks it.
    share_prompt: bool = True
    # > 0: pack the batch's rollouts into rows of this many tokens, several a row as documents
    # (`jaxagent.steps.pack_budget`: same loss and gradients) instead of one row per rollout
    # right-padded to the longest; train.micro_batch then counts these rows. Needs
    # share_prompt: false; a rollout longer than this is an error. 0 = one row per rollout.
    pack_tokens: int = 0


@dataclass(frozen=True)
class RolloutConfig:
    max_staleness: int = 1  # policy versions the sampler may run ahead; 0 = synchronous


@dataclass(frozen=True)
class DocumentDataConfig:
    """The synthetic retrieval family (rollouts/tasks/documents.py) for `sft.data: documents`."""

    num_documents: int = 4
    entries: int = 3  # key=value lines per document
    eval_examples: int = 256  # held out: answer accuracy before and after SFT


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 40  # supervised warm-up steps before RL (on the tasks' reference solutions)
    batch_size: int = 64
    learning_rate: float = 2e-3
    # tasks: imitate the training tasks' references. documents: the synthetic retrieval family
    # laid out for document attention, loss on the final section's answer. agent: scripted tool
    # episodes over agent.tasks (rollouts.agent.demos), loss on the actions only.
    data: Literal["tasks", "documents", "agent"] = "tasks"
    documents: DocumentDataConfig = field(default_factory=DocumentDataConfig)
    # agent only: `copy_steps` on short copy rows before `steps` on whole demonstrations,
    # `copy_batch_size` rows a step. copy_data: demonstrations (rollouts.agent.demos.copy_rows:
    # the message an action copies from, loss on the copied argument values) or paths
    # (path_copy_rows: a made-up path in a one-line message, then read_file of it)
    copy_steps: int = 0
    copy_batch_size: int = 16
    copy_data: Literal["demonstrations", "paths"] = "demonstrations"
    # agent only: each drawn demonstration with its task's facts drawn afresh
    # (rollouts.tasks.agent_family.redraw), so the facts cannot be memorised, only copied
    redraw_facts: bool = False
    # agent only: extra loss weight on each action token that spells a redrawn fact (a turn's
    # tokens share weight 1, so a two-digit value would otherwise weigh ~1/100 of an edit)
    fact_weight: float = 0.0
    # agent only: loss weight per token on what the environment wrote (prompt and tool
    # output; 0: actions only). A byte model starts with no copying circuit, and the outputs
    # repeat their own paths, names and values (pytest prints a failing value three times), so
    # predicting them trains the lookup the actions' copies need (docs/agent.md, eleventh session)
    observation_weight: float = 0.0
    # agent only: this share of the demonstrations (drawn per task from the seed) first make
    # the task's blind guess, see the tests fail, then fix it (rollouts.agent.demos.
    # recovery_calls); no loss on the wrong edit. Needs agent.max_turns for the longer script
    recovery: float = 0.0
    # agent over the embedded family only: teacher-forced scripted demonstrations of this many
    # held-out tasks (not the evaluated ones: agent_family.validation_tasks), every
    # `valid_every` steps (0: at the end only): the share of calls, by tool, and of whole
    # demonstrations whose every token is the greedy prediction (sft/valid_exact/*), which
    # shows minutes into a warm-up whether it learnt to copy the facts the calls need
    valid_tasks: int = 0
    valid_every: int = 0
    # stop the warm-up (before `steps`) at the first validation where this share of the
    # validation demonstrations is exact throughout (0: never); `sft/steps` says when it stopped
    valid_stop: float = 0.0
    # the share valid_stop reads: of all the validation demonstrations ("episode"), the
    # least among the task templates' ("template": every template begun, whatever the others),
    # or the mean chance that an episode sampled as the evaluation samples replays a
    # demonstration's calls ("sampled", sft/valid_sampled/episode: a smooth figure near the
    # held-out pass rate the warm-up leaves, where the exact shares count a few demonstrations)
    valid_stop_by: Literal["episode", "template", "sampled"] = "episode"


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 25  # steps; 0 = only at the end
    keep: int = 3
    # resume with changed train.steps / logging / eval / checkpoint settings (any other change
    # to a run's config is refused: jaxagent.workdir.check_resume_config)
    allow_changes: bool = False


@dataclass(frozen=True)
class EvalConfig:
    every: int = 25  # steps; 0 = before RL and at the end only
    samples: int = 4  # completions per task
    k: tuple[int, ...] = (1,)
    temperature: float = 1.0
