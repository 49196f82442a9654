"""The `agent` config section: multi-turn tool episodes over repository tasks."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rollouts.agent.formats import make_format


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Episode budgets and behaviour, which `ToolEnvironment` reads, and how a run uses
    episodes, which the trainer and the `agent` command read (`enabled`, `tasks`, `eval_tasks`,
    `tools`, `episodes`, `max_action_tokens`, `memory`, `embedding`, `feedback_*`). An episode
    that edits the tests earns `-rewards.hack_penalty` (its scorer's `RewardConfig`)."""

    enabled: bool = False  # train on agent episodes over agent.tasks instead of single completions
    # A directory of deletion tasks (DIR/ID/task.json; no held-out split), or `embedded:N[:SEED]`:
    # N tasks of the embedded agent family (rollouts.tasks.agent_family) minus its held-out fifth
    tasks: str = "rollouts/tasks/data/textkit_tasks"
    eval_tasks: int = 8  # held-out tasks of an embedded family that agent evaluation plays
    templates: tuple[str, ...] = ()  # the embedded family's templates drawn in turn (empty: all)
    # the embedded family's package/module names: made up per task (paths must be copied from
    # what was read) or fixed (`app/core.py` in every task: the easier set)
    task_names: Literal["made_up", "fixed"] = "made_up"
    # The tools episodes offer (rollouts.tools.TOOLS names; empty: all). Fewer tools, a shorter
    # prompt: the compact format spends ~20 of the byte model's tokens per tool signature.
    tools: tuple[str, ...] = ()
    call_format: Literal["hermes", "compact"] = "compact"  # hermes: Qwen <tool_call>; compact: @name {json}
    episodes: int = 8  # episodes in flight (sampler slots); a finished one's slot is refilled
    max_turns: int = 8
    max_context_tokens: int = 4096  # prompt + actions + observations
    max_action_tokens: int = 128  # tokens sampled per turn
    tool_timeout_s: float = 10.0  # one tool call's wall and CPU limit
    # `run_tests` reads an earlier clean run on the same files (any episode's) instead of
    # running again (rollouts.sandbox.run_cache): for task families whose tests are
    # deterministic (the embedded family). Grading always runs.
    test_cache: bool = False
    episode_timeout_s: float = 300.0
    max_output_chars: int = 2000  # a tool's output beyond this is cut (head + tail, with a note)
    truncation: Literal["mask", "penalty"] = "mask"  # budget-cut episodes: out of the advantage, or penalised
    truncation_penalty: float = 1.0
    # subtracted from the reward per malformed, unknown or ill-typed call (a format penalty as
    # RAGEN's -0.1): groups that all fail still differ in it (measured on the tiny agent: it
    # did not lower the bad calls, docs/agent.md)
    bad_call_penalty: float = 0.0
    # an episode whose tool calls went looking for the deleted code (rollouts.agent.monitor)
    # earns at most 0
    zero_lookup_reward: bool = False
    memory: bool = True  # the memory tool's notes persist under WORKDIR/agent_memory
    embedding: Literal["ngram", "minilm"] = "ngram"  # semantic search; minilm: extra `semantic`
    feedback_detectors: tuple[str, ...] = ()  # bad_tool_call, test_edit, repeat
    feedback_beta: float = 0.0  # weight of KL(teacher || policy) at flagged turns
    # The teacher at a flagged turn: the policy reading the detector's hint, the task's
    # scripted demonstration (`script`: its next call, as a target; tasks with a reference),
    # or the policy restricted to the tokens that keep the call well-formed (`grammar`: up to
    # the turn's first token that broke it; the compact format, bytes or a byte-level BPE)
    feedback_teacher: Literal["hint", "script", "grammar"] = "hint"
    # A detector's hint in place of its English default (rollouts.agent.feedback.HINTS): the
    # teacher is the policy reading it, so it must be text the policy can read (a byte model
    # trained only on episodes reads its own call format, not English).
    feedback_hints: dict[str, str] = dataclasses.field(default_factory=dict)
    # Flagged turns per step that get the KL (the batch's first ones): each costs a forward
    # pass over its context with and without the hint.
    feedback_max_examples: int = 4
    # Reverse curriculum: the fraction of training groups whose episodes start after the first
    # k calls of the task's scripted demonstration (k drawn per group from 1 to the calls before
    # the script's first edit), so the sampled turns begin near the edit. The scripted calls
    # sit in the prompt (no loss) and count against max_turns; evaluation never uses them.
    scripted_prefix: float = 0.0
    # Off-policy guidance (LUFFY's, Yan et al. 2025): the fraction of training groups in which
    # no episode passed whose worst episode is replaced by the task's scripted demonstration,
    # played in the environment: a pass for the group's leave-one-out advantage to reinforce
    # where sampling found none. The trainer weighs its tokens as if sampled by the policy
    # being updated (ratio and importance weight 1). Evaluation never uses it.
    guidance: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_context_tokens", "tool_timeout_s", "episode_timeout_s",
                     "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AgentConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.bad_call_penalty < 0:
            raise ValueError(f"AgentConfig.bad_call_penalty must be >= 0, got {self.bad_call_penalty!r}")
        if not 0.0 <= self.scripted_prefix <= 1.0:
            raise ValueError(f"AgentConfig.scripted_prefix is a fraction of groups in [0, 1], "
                             f"got {self.scripted_prefix!r}")
        if not 0.0 <= self.guidance <= 1.0:
            raise ValueError(f"AgentConfig.guidance is a fraction of groups in [0, 1], "
                             f"got {self.guidance!r}")
        if self.task_names not in ("made_up", "fixed"):
            raise ValueError(f"AgentConfig.task_names must be 'made_up' or 'fixed', got {self.task_names!r}")
        if self.truncation not in ("mask", "penalty"):
            raise ValueError(f"AgentConfig.truncation must be 'mask' or 'penalty', got {self.truncation!r}")
        make_format(self.call_format)
        from rollouts.agent.feedback import HINTS  # the detectors' names live with their hints

        unknown = sorted(set(self.feedback_hints) - set(HINTS))
        if unknown or not all(isinstance(h, str) and h.strip() for h in self.feedback_hints.values()):
            raise ValueError(f"AgentConfig.feedback_hints maps detectors {sorted(HINTS)} to non-empty "
                             f"text, got {self.feedback_hints!r}")
