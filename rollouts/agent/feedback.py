"""Targeted feedback, host side: which turns the detectors flag, and the teacher's context
(the same tokens with a hint inserted before the flagged turn) aligned with the student's.

The loss itself is `jaxagent.rl.feedback` (`token_kl`, `feedback_loss`): the trainer runs the
policy on the student sequence and (without gradient) on each teacher sequence, takes the
logits at the returned indices (those that predict the flagged turn's tokens) and masks with
`mask`. The scripted teacher (`correction_examples`) has no teacher sequence: the student
sequence ends with the script's call in place of the turn, and the loss is `target_kl`. The
grammar teacher (`grammar_examples`) has none either: the student sequence is the turn as
sampled, up to its first byte that breaks the call, with the bytes allowed at each position
(`rollouts.agent.grammar`), and the loss is `allowed_kl`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rollouts.environment import Trajectory

HINTS = {
    "bad_tool_call": "Hint: your last tool call could not be run. Call exactly one of the listed "
                     "tools, by its exact name, with JSON arguments that match its parameters.",
    "test_edit": "Hint: do not edit the tests; edits to them are discarded and the episode earns "
                 "nothing. Change the code under test instead.",
    "repeat": "Hint: you are repeating your previous turn, which will give the same result. Try a "
              "different action.",
}


def action_spans(policy_mask: Sequence[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of policy tokens: one per turn."""
    m = np.concatenate([[0], np.asarray(policy_mask, int), [0]])
    edges = np.flatnonzero(np.diff(m))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


@dataclass(frozen=True)
class FeedbackExample:
    """One flagged turn: the teacher sequence and the aligned logit indices of both."""

    detector: str
    student_tokens: list[int]  # the context up to the end of the turn
    teacher_tokens: list[int] | None  # None: the scripted teacher (the targets are its call)
    student_index: np.ndarray  # [n] positions in the student sequence whose logits predict the turn
    teacher_index: np.ndarray | None  # [n] the same predictions in the teacher sequence
    targets: np.ndarray  # [n] the turn's tokens (the scripted teacher's: its call's)
    allowed: np.ndarray | None = None  # [n, V] bool: the grammar teacher's tokens per position


def flagged_turns(traj: Trajectory, detectors: Sequence[str]) -> list[tuple[int, int, str]]:
    """(start, end, detector) of each turn a chosen detector flagged (the first that fired)."""
    unknown = sorted(set(detectors) - set(HINTS))
    if unknown:
        raise ValueError(f"unknown feedback detector(s) {unknown}; choose from {sorted(HINTS)}")
    # an episode started after scripted calls (a reverse curriculum) holds them in its prompt
    flags = traj.info.get("turn_flags", [])[traj.info.get("prefix_calls", 0):]
    spans = action_spans(traj.policy_mask)
    if len(flags) != len(spans):
        raise ValueError(f"trajectory {traj.task_id}: {len(spans)} turns but {len(flags)} turn flags")
    out = []
    for (start, end), fired in zip(spans, flags, strict=True):
        name = next((d for d in detectors if fired.get(d)), None)
        if name is not None:
            out.append((start, end, name))
    return out


def feedback_examples(traj: Trajectory, tokenizer, detectors: Sequence[str],
                      hints: Mapping[str, str] = HINTS) -> list[FeedbackExample]:
    """A teacher example per flagged turn: the hint's tokens go right before the turn."""
    return turn_examples(traj.tokens, flagged_turns(traj, detectors), tokenizer, hints)


def turn_examples(tokens: Sequence[int], flagged: Sequence[tuple[int, int, str]], tokenizer,
                  hints: Mapping[str, str] = HINTS) -> list[FeedbackExample]:
    """`feedback_examples` from a sequence and its `flagged_turns` (as a `Rollout` keeps them)."""
    tokens = list(tokens)
    examples = []
    for start, end, name in flagged:
        hint = tokenizer.encode("\n" + hints[name] + "\n")
        teacher = tokens[:start] + hint + tokens[start:end]
        student_index = np.arange(start - 1, end - 1)
        examples.append(FeedbackExample(name, tokens[:end], teacher, student_index,
                                        student_index + len(hint), np.asarray(tokens[start:end])))
    return examples


def correction_examples(tokens: Sequence[int], flagged: Sequence[tuple[int, int, str]],
                        corrections: Sequence[Sequence[int]]) -> list[FeedbackExample]:
    """A scripted-teacher example per flagged turn: the context before the turn, then the
    script's call for it (`rollouts.agent.demos.scripted_corrections`) as the targets."""
    tokens = list(tokens)
    examples = []
    for (start, _, name), call in zip(flagged, corrections, strict=True):
        examples.append(FeedbackExample(name, tokens[:start] + list(call), None,
                                        np.arange(start - 1, start - 1 + len(call)), None,
                                        np.asarray(call)))
    return examples


def grammar_examples(tokens: Sequence[int], flagged: Sequence[tuple[int, int, str]], grammar,
                     stop_ids: Sequence[int], vocab_size: int) -> list[FeedbackExample]:
    """A grammar-teacher example per flagged turn that leaves the call grammar (`grammar`: a
    `rollouts.agent.grammar.CallGrammar`): the context and the turn up to and including its
    first refused token, with the allowed tokens at each of those positions. A flagged turn
    that is a well-formed call (a wrong path, a repeat) has no byte to correct and is left out."""
    tokens = list(tokens)
    examples = []
    for start, end, name in flagged:
        allowed = grammar.off_grammar(tokens[start:end], stop_ids, vocab_size)
        if allowed is None:
            continue
        stop = start + len(allowed)
        examples.append(FeedbackExample(name, tokens[:stop], None, np.arange(start - 1, stop - 1),
                                        None, np.asarray(tokens[start:stop]), allowed))
    return examples
