"""Scripted demonstrations for the SFT warm-up: a repository task solved through the real
environment (run the tests, read the code, edit in the reference, run the tests, finish), recorded
token-exactly as a `Trajectory` whose policy mask covers only the scripted actions (a recovery
demonstration: a wrong guess, its failing run, then the fix); and the copy warm-up's short
rows: cut from them (`copy_rows`) or made up (`path_copy_rows`)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import random
from collections.abc import Callable, Collection, Sequence

from rollouts.agent.feedback import action_spans
from rollouts.agent.formats import ToolCall
from rollouts.environment import Environment, Trajectory
from rollouts.tasks.agent_family import made_up_word, redraw, substitute, whole
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


def reference_line_edits(path: str, before: str, after: str) -> list[ToolCall]:
    """`replace_line` calls turning `before` into `after`, bottom to top (so each line number
    is the one the unedited file's view shows): a changed line becomes its new text, a hunk of
    k old lines and m > k new ones k calls whose last holds the m - k + 1 remaining lines, and
    a pure insertion rewrites the shorter neighbouring line with the new lines above or below
    it. A hunk that deletes lines has no such script (the tool never removes a line)."""
    old, new = before.splitlines(), after.splitlines()
    calls = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in reversed(matcher.get_opcodes()):
        if tag == "equal":
            continue
        if i2 - i1 > j2 - j1:
            raise ValueError(f"{path}: lines {i1 + 1}-{i2} shrink to {j2 - j1}; replace_line "
                             "cannot delete lines (use edit)")
        if i1 == i2:  # an insertion: onto the line above or below, whichever is shorter
            above = old[i1 - 1] if i1 > 0 else None
            below = old[i1] if i1 < len(old) else None
            if above is None and below is None:
                raise ValueError(f"{path}: empty; replace_line needs a line to rewrite")
            if below is None or (above is not None and len(above) <= len(below)):
                calls.append(_line_call(path, i1, [above, *new[j1:j2]]))
            else:
                calls.append(_line_call(path, i1 + 1, [*new[j1:j2], below]))
            continue
        rest = new[j1 + i2 - i1 - 1:j2]  # the last old line takes every extra new line
        calls.append(_line_call(path, i2, rest))
        calls += [_line_call(path, i1 + k + 1, [new[j1 + k]]) for k in reversed(range(i2 - i1 - 1))]
    return calls


def _line_call(path: str, line: int, lines: list[str]) -> ToolCall:
    return ToolCall("replace_line", {"path": path, "line": line, "text": "\n".join(lines)})


EDIT_TOOLS = {"edit": reference_edits, "replace_line": reference_line_edits}


def scripted_calls(task: Task, edit_tool: str = "edit") -> list[ToolCall]:
    """run_tests (see what fails), read_file (`metadata["reads"]`, a JSON list of paths in the
    order a solver would open them; default: the first file the reference changes), the edits
    to each changed file's reference with `edit_tool` (`edit` or `replace_line`), run_tests,
    finish. The first action is the same for every task, so even the tiny model learns to open
    an episode with a valid call."""
    reference = _edited_files(task, "reference")
    return [*_opening(task, reference), *_edits(edit_tool, task.files, reference),
            ToolCall("run_tests", {}), ToolCall("finish", {})]


def recovery_calls(task: Task, edit_tool: str = "edit") -> tuple[list[ToolCall], list[int]]:
    """A first attempt that fails, then its fix: run_tests and the reads (as `scripted_calls`),
    the task's `metadata["blind"]` edits (the guess from the prompt alone, on the line(s) the
    reference changes), run_tests (it fails and shows the fact again), the edits from there to
    the reference (with `replace_line`, the same line numbers), run_tests, finish. Also the
    positions of the wrong edits among the calls: context, not to imitate."""
    reference, blind = _edited_files(task, "reference"), _edited_files(task, "blind")
    # a guess the fix undoes, that changes something and is not already right (so
    # `redraw_recovery`'s empty mapping keeps it wrong)
    if any(p not in reference or blind[p] in (task.files.get(p, ""), reference[p])
           for p in blind):
        raise ValueError(f"task {task.id}: metadata['blind'] must change files the reference "
                         "changes, to other contents than the file's and the reference's")
    reads, guess = _opening(task, reference), _edits(edit_tool, task.files, blind)
    fix = _edits(edit_tool, {**task.files, **blind}, reference)
    calls = [*reads, *guess, ToolCall("run_tests", {}), *fix, ToolCall("run_tests", {}),
             ToolCall("finish", {})]
    return calls, list(range(len(reads), len(reads) + len(guess)))


def _edited_files(task: Task, key: str) -> dict[str, str]:
    """`metadata[key]`: edits as JSON {path: new content} (a repository task's `reference`, the
    passing ones; the embedded family's `blind`, a guess that fails)."""
    try:
        files = json.loads(task.metadata.get(key) or "")
    except json.JSONDecodeError:
        files = None
    if not isinstance(files, dict) or not files:
        raise ValueError(f"task {task.id}: metadata[{key!r}] holds no files to demonstrate")
    return files


def _opening(task: Task, reference: dict[str, str]) -> list[ToolCall]:
    """run_tests, then read_file of each of `metadata["reads"]` (default: the first file the
    reference changes)."""
    reads = (json.loads(task.metadata["reads"]) if "reads" in task.metadata
             else sorted(reference)[:1])
    return [ToolCall("run_tests", {}), *(ToolCall("read_file", {"path": p}) for p in reads)]


def _edits(edit_tool: str, before: dict[str, str], after: dict[str, str]) -> list[ToolCall]:
    """`edit_tool` calls turning each file of `after` from its content in `before` (absent:
    empty) into its content in `after`, file by file in path order."""
    if edit_tool not in EDIT_TOOLS:
        raise ValueError(f"edit_tool {edit_tool!r}: scripted edits use one of {sorted(EDIT_TOOLS)}")
    return [c for p in sorted(after) for c in EDIT_TOOLS[edit_tool](p, before.get(p, ""), after[p])]


def next_scripted_call(script: Sequence[ToolCall], ran: Sequence[ToolCall]) -> ToolCall:
    """The call `script` (`scripted_calls`) makes next after the calls that `ran`: its first
    call not matched when `ran` is read, in order, against it (a call other than the script's
    next, such as a wrong edit, matches nothing, so the script's edit is still to come)."""
    i = 0
    for call in ran:
        i += i < len(script) - 1 and call == script[i]
    return script[i]


def scripted_corrections(traj: Trajectory, task: Task, flagged: Sequence[tuple[int, int, str]],
                         fmt, tokenizer, edit_tool: str = "edit",
                         prefix: Sequence[ToolCall] = ()) -> list[list[int]]:
    """The scripted teacher's turn at each of `flagged` (`flagged_turns` of `traj`): the tokens
    of `next_scripted_call` after the calls that ran before that turn (`prefix`, the scripted
    calls the episode started after, then the policy's turns that were not bad calls), written
    as `demonstrate` writes a call (its text, then the first stop token)."""
    script = scripted_calls(task, edit_tool)
    ran, before = list(prefix), {}
    flags = traj.info.get("turn_flags", [])[len(prefix):]
    for (a, b), fired in zip(action_spans(traj.policy_mask), flags, strict=True):
        before[a] = list(ran)
        call = fmt.parse(tokenizer.decode(traj.tokens[a:b]))
        if not fired.get("bad_tool_call") and isinstance(call, ToolCall):
            ran.append(call)
    return [tokenizer.encode(fmt.render_call(next_scripted_call(script, before[start])))
            + list(tokenizer.stop_ids[:1]) for start, _, _ in flagged]


def without_actions(policy_mask: Sequence[bool], actions: Collection[int]) -> list[bool]:
    """`policy_mask` with the tokens of the `actions` (numbered from 0 in order) taken out:
    they stay in the context and carry no loss (a recovery demonstration's wrong edits)."""
    out = list(policy_mask)
    for k, (a, b) in enumerate(action_spans(policy_mask)):
        if k in actions:
            out[a:b] = [False] * (b - a)
    return out


def redraw_recovery(task: Task, rng: random.Random) -> dict[str, str]:
    """`redraw` for a recovery demonstration of `task`: drawn again while its wrong edit
    (`metadata["blind"]`), under the new facts, would be the file as it was or the reference
    (then it would change nothing or pass). An empty mapping keeps it wrong, so this ends."""
    reference, blind = _edited_files(task, "reference"), _edited_files(task, "blind")
    while True:
        mapping = redraw(task, rng)
        if all(substitute(guess, mapping) not in (substitute(task.files.get(p, ""), mapping),
                                                  substitute(reference[p], mapping))
               for p, guess in blind.items()):
            return mapping


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


def scripted_start(env: Environment, task: Task, calls: Sequence[ToolCall],
                   version: int) -> Trajectory:
    """An episode of `task` that starts after `calls` (played as `demonstrate` plays them): its
    prompt is the task's prompt, the calls and their observations, token for token what the
    sampler would have seen, all outside the policy mask (no loss, no log-probs); the
    environment has counted the calls as turns. `info["prefix_calls"]` says how many. Done
    already if the calls ended the episode."""
    demo = demonstrate(env, task, calls)
    traj = Trajectory.start(task.id, demo.tokens, version)
    traj.reward, traj.done = demo.reward, demo.done
    traj.info = {**demo.info, "prefix_calls": len(calls)}
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


def substitute_trajectory(traj: Trajectory, mapping: dict[str, str], tokenizer) -> Trajectory:
    """`traj` with `substitute(text, mapping)` applied to each run of prompt, observation or
    action text, re-encoded (special tokens, such as an action's stop token, kept in place); the
    policy mask and the prompt length follow. With `rollouts.tasks.agent_family.redraw`'s
    mapping this is the demonstration of the task's other draw, token for token."""
    if not mapping:
        return traj
    tokens, mask, seen = [], [], {}

    def plain(t: int) -> bool:  # text that survives decode + encode (not a special token)
        if t not in seen:
            seen[t] = tokenizer.encode(tokenizer.decode([t])) == [t]
        return seen[t]

    start, n = 0, len(traj.tokens)
    prompt_len = None
    while start < n:
        end = start + 1  # a run: same mask, all plain text, within the prompt or after it
        while (end < n and traj.policy_mask[end] == traj.policy_mask[start]
               and end != traj.prompt_len and plain(traj.tokens[end]) == plain(traj.tokens[start])):
            end += 1
        run = traj.tokens[start:end]
        if plain(run[0]):
            run = tokenizer.encode(substitute(tokenizer.decode(run), mapping))
        if start == traj.prompt_len:
            prompt_len = len(tokens)
        tokens += run
        mask += [traj.policy_mask[start]] * len(run)
        start = end
    return dataclasses.replace(traj, tokens=tokens, policy_mask=mask, logprobs=[0.0] * len(tokens),
                               prompt_len=len(tokens) if prompt_len is None else prompt_len)


def fact_tokens(traj: Trajectory, mapping: dict[str, str], tokenizer) -> list[bool]:
    """True at the action tokens that spell a whole occurrence of a value of `mapping` (in a
    redrawn demonstration: the facts the actions copy from the context)."""
    out = [False] * len(traj.tokens)
    values = [v for v in mapping.values() if v]
    if not values:
        return out
    pattern = whole(values)
    for a, b in action_spans(traj.policy_mask):
        action = traj.tokens[a:b]
        ends = _text_ends(tokenizer, action)
        for m in pattern.finditer(tokenizer.decode(action)):
            for i in _overlapping(ends, m.start(), m.end()):
                out[a + i] = True
    return out


def _text_ends(tokenizer, tokens: Sequence[int]) -> list[int]:
    """The length of the text of each prefix of `tokens` (0 through all of them)."""
    return [len(tokenizer.decode(list(tokens[:i]))) for i in range(len(tokens) + 1)]


def _overlapping(ends: list[int], lo: int, hi: int) -> list[int]:
    """The tokens (by `_text_ends`) whose text overlaps the characters [lo, hi)."""
    return [i for i in range(len(ends) - 1) if ends[i] < hi and ends[i + 1] > lo]


def value_spans(tokenizer, action: Sequence[int], call: ToolCall,
                text: str) -> dict[str, tuple[int, int]]:
    """{argument: [start, end) of the tokens of `action` (`text`, the rendered `call`) that spell
    its value (a string's inside its quotes)}. A token counts when its bytes overlap the
    value's (byte-level tokens: exactly the value)."""
    ends = _text_ends(tokenizer, action)
    spans, pos = {}, 0
    for key, value in call.args.items():
        # every format writes its arguments with json.dumps' default separators
        pair = f"{json.dumps(key)}: {json.dumps(value)}"
        at = text.index(pair, pos)
        quote = int(isinstance(value, str))
        lo, hi = at + len(json.dumps(key)) + 2 + quote, at + len(pair) - quote
        toks = _overlapping(ends, lo, hi)
        at_lo = next(i for i, end in enumerate(ends) if end >= lo)  # an empty value's place
        spans[key] = (toks[0], toks[-1] + 1) if toks else (at_lo, at_lo)
        pos = at + len(pair)
    return spans


# an edit's arguments copied from the file's view, and the one holding the fact
COPIED_FROM_VIEW = {"edit": (["path", "search"], ["replace"]),
                    "replace_line": (["path", "line"], ["text"])}


def copy_rows(traj: Trajectory, calls: Sequence[ToolCall], tokenizer, render) -> list[
        tuple[list[int], list[int], list[float]]]:
    """The copy warm-up's rows cut from a scripted demonstration (`scripted_calls` played by
    `demonstrate`): each is (context, action prefix, loss weights over the prefix), where the
    context is the one message an action copies from and the weights are 1 on the copied
    argument values only, so a step's loss is all copying, on rows a few hundred tokens long
    rather than 1.5k (not enough alone for the 2-layer default: docs/agent.md):

      read_file path            from the previous read (`path` in its imports), or the prompt
      edit path and search      from the last read (the file's view)
      edit replace              from the first turn (the failing tests' output: the fact)
      replace_line path, line   from the last read
      replace_line text         from the first turn

    `render(call)` is the format's text of a call. The prefix ends at the last weighted value
    (the closing quote and the rest of the call are not needed to teach the copy)."""
    spans = action_spans(traj.policy_mask)
    if len(spans) != len(calls):
        raise ValueError(f"demonstration {traj.task_id}: {len(spans)} actions for {len(calls)} "
                         "calls (cut short?)")
    turn = [traj.tokens[a:(spans[k + 1][0] if k + 1 < len(spans) else len(traj.tokens))]
            for k, (a, _) in enumerate(spans)]  # an action and the observation it got
    prompt = traj.tokens[:traj.prompt_len]
    rows, last_read = [], None
    for k, (call, (a, b)) in enumerate(zip(calls, spans)):
        action = traj.tokens[a:b]
        values = value_spans(tokenizer, action, call, render(call))
        if call.name == "read_file":
            sources = [(prompt if last_read is None else turn[last_read], ["path"])]
            last_read = k
        elif call.name in COPIED_FROM_VIEW and last_read is not None:
            view, fact = COPIED_FROM_VIEW[call.name]
            sources = [(turn[last_read], view), (turn[0], fact)]
        else:
            continue
        for context, keys in sources:
            weights = [0.0] * max(values[key][1] for key in keys)
            for key in keys:
                lo, hi = values[key]
                weights[lo:hi] = [1.0] * (hi - lo)
            rows.append((list(context), list(action[:len(weights)]), weights))
    return rows


def path_copy_rows(rng: random.Random, n: int, tokenizer, render: Callable[[ToolCall], str],
                   ) -> list[tuple[list[int], list[int], list[float]]]:
    """`n` made-up rows that teach copying alone: a one-line user message naming a made-up path
    among made-up words, then `read_file` of that path, the loss on the path only (~100 tokens
    a row; names drawn as the agent family draws them, so none can be recalled). On these the
    tiny model forms its copying heads in a few hundred steps, where 300 steps of
    `copy_rows` (the same skill inside 370-token tool outputs) did not."""
    rows = []
    for _ in range(n):
        path = f"{made_up_word(rng, 3)}/{made_up_word(rng, 2)}.py"
        a, b, c = (made_up_word(rng, rng.choice((2, 3))) for _ in range(3))
        message = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"The {a} of {b} in {path} is wrong ({c}). Fix it."}])
        call = ToolCall("read_file", {"path": path})
        text = render(call)
        action = tokenizer.encode(text)
        lo, hi = value_spans(tokenizer, action, call, text)["path"]
        rows.append((tokenizer.encode(message, add_bos=tokenizer.add_bos), action[:hi],
                     [0.0] * lo + [1.0] * (hi - lo)))
    return rows
