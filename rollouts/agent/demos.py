"""Scripted demonstrations for the SFT warm-up: a repository task solved through the real
environment (run the tests, read the code, edit in the reference, run the tests, finish), recorded
token-exactly as a `Trajectory` whose policy mask covers only the scripted actions."""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence

from rollouts.agent.formats import ToolCall
from rollouts.environment import Environment, Trajectory
from rollouts.tasks.task import Task


def _unique_at(text: str, part: str, at: int) -> bool:
    """`part` occurs in `text` once (overlaps counted), at offset `at`."""
    return text.find(part) == at and text.find(part, at + 1) == -1


def reference_edits(path: str, before: str, after: str) -> list[ToolCall]:
    """`edit` calls turning `before` into `after`, top to bottom, one per changed hunk; each
    search text is the hunk grown until it occurs once (short actions, unlike rewriting the
    whole file). A pure insertion anchors on the line above or the line below, whichever
    gives the shorter search text."""
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    starts = [0]
    for line in old:
        starts.append(starts[-1] + len(line))
    calls = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        k = i1 if i2 > i1 else max(i1 - 1, 0)  # an insertion anchors on the line above
        while k > 0 and not _unique_at(before, "".join(old[k:i2]), starts[k]):
            k -= 1
        search, replace = "".join(old[k:i2]), "".join(old[k:i1] + new[j1:j2])
        if i1 == i2 < len(old):  # or on the line below, grown downwards
            e = i1 + 1
            while e < len(old) and not _unique_at(before, "".join(old[i1:e]), starts[i1]):
                e += 1
            below = "".join(old[i1:e])
            if _unique_at(before, below, starts[i1]) and (
                    len(below) < len(search) or not _unique_at(before, search, starts[k])):
                search, replace = below, "".join(new[j1:j2]) + below
        calls.append(ToolCall("edit", {"path": path, "search": search, "replace": replace}))
    return calls


def scripted_calls(task: Task) -> list[ToolCall]:
    """run_tests (see what fails), read_file (`metadata["reads"]`, a JSON list of paths in the
    order a solver would open them; default: the first file the reference changes), the edits
    to each changed file's reference, run_tests, finish. The first action is the same for every
    task, so even the tiny model learns to open an episode with a valid call."""
    # A repository task's reference is its passing edits as JSON {path: content}.
    try:
        reference = json.loads(task.metadata.get("reference") or "")
    except json.JSONDecodeError:
        reference = None
    if not isinstance(reference, dict) or not reference:
        raise ValueError(f"task {task.id}: metadata['reference'] holds no files to demonstrate")
    paths = sorted(reference)
    reads = json.loads(task.metadata["reads"]) if "reads" in task.metadata else paths[:1]
    return [ToolCall("run_tests", {}), *(ToolCall("read_file", {"path": p}) for p in reads),
            *(c for p in paths for c in reference_edits(p, task.files.get(p, ""), reference[p])),
            ToolCall("run_tests", {}), ToolCall("finish", {})]


def demonstrate(env: Environment, task: Task, calls: Sequence[ToolCall]) -> Trajectory:
    """Play `calls` in `env` as if sampled (each call's text, then the first stop token, with
    log-prob 0); the trajectory ends where the episode does."""
    tok = env.tokenizer
    traj = Trajectory.start(task.id, env.reset(task), version=0)
    for call in calls:
        action = tok.encode(env.format.render_call(call)) + list(tok.stop_ids[:1])
        traj.add_action(action, [0.0] * len(action))
        traj.record(env.step(action))
        if traj.done:
            break
    return traj


def turn_weights(policy_mask: Sequence[bool]) -> list[float]:
    """Per-token loss weights that give every policy turn the same total weight 1: imitating
    a demonstration then counts its short calls (run_tests, finish) as much as its long edits,
    which would otherwise hold nearly all of the token-mean loss."""
    weights = [0.0] * len(policy_mask)
    start = None
    for i, m in enumerate([*policy_mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            weights[start:i] = [1.0 / (i - start)] * (i - start)
            start = None
    return weights

