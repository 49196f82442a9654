"""Copy rows cut from scripted demonstrations: each is the message an action copies from and
the action up to its copied values, with the loss on exactly those values."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from jaxagent.tokenizer import ByteTokenizer
from rollouts.agent import AgentConfig, ToolEnvironment
from rollouts.agent.demos import (
    copy_rows,
    demonstrate,
    fact_tokens,
    next_scripted_call,
    path_copy_rows,
    recovery_calls,
    redraw_recovery,
    reference_line_edits,
    scripted_calls,
    scripted_corrections,
    scripted_start,
    substitute_trajectory,
    value_spans,
    without_actions,
)
from rollouts.agent.feedback import action_spans, flagged_turns
from rollouts.agent.formats import ToolCall, make_format
from rollouts.rewards import Scorer
from rollouts.sandbox.session import Session
from rollouts.tasks.agent_family import (
    TEMPLATES,
    agent_family_tasks,
    redraw,
    substitute,
    whole,
)
from rollouts.tools import ToolContext
from rollouts.tools.builtin import replace_line

TOK = ByteTokenizer()


def _runs(weights):
    """[start, end) of each run of weight-1 tokens; every weight is 0 or 1."""
    assert set(weights) <= {0.0, 1.0}
    return action_spans([w == 1.0 for w in weights])


@pytest.fixture(scope="module")
def played():
    """Scripted demonstrations of a one-read and a two-read template (the made-up names)."""
    tasks = agent_family_tasks(3, seed=5, templates=["constant", "hidden_file"])[:2]
    fmt = make_format("compact")
    with Scorer(workers=1) as scorer:
        out = []
        for task in tasks:
            env = ToolEnvironment(TOK, AgentConfig(max_turns=8, max_context_tokens=4096,
                                                   call_format="compact"), scorer=scorer)
            calls = scripted_calls(task)
            traj = demonstrate(env, task, calls)
            env.close()
            assert traj.info["passed"]
            out.append((task, traj, calls, copy_rows(traj, calls, TOK, fmt.render_call)))
    return out


def test_value_spans_cover_exactly_each_json_string_value():
    call = ToolCall("edit", {"path": "kavo/mi.py", "search": "A = 1\n", "replace": ""})
    text = make_format("compact").render_call(call)
    action = TOK.encode(text)
    spans = value_spans(TOK, action, call, text)
    assert TOK.decode(action[slice(*spans["path"])]) == "kavo/mi.py"
    assert TOK.decode(action[slice(*spans["search"])]) == "A = 1\\n"  # as the JSON spells it
    lo, hi = spans["replace"]
    assert lo == hi and TOK.decode(action[:lo]).endswith('"replace": "')


def test_value_spans_of_an_integer_cover_its_digits():
    call = ToolCall("replace_line", {"path": "app/core.py", "line": 13, "text": "X = 2"})
    text = make_format("compact").render_call(call)
    action = TOK.encode(text)
    spans = value_spans(TOK, action, call, text)
    values = [TOK.decode(action[slice(*spans[k])]) for k in call.args]
    assert values == ["app/core.py", "13", "X = 2"]


def test_line_edits_turn_the_file_into_the_reference():
    """Random files changed by random hunks (a line rewritten, lines inserted at the top, the
    middle or the end, one line grown into several): the scripted `replace_line` calls, run by
    the real tool one after another, give the reference exactly, with line numbers of the
    unedited file."""
    rng = random.Random(11)
    with Session({}) as session:
        ctx = ToolContext(session, task=None)
        for case in range(60):
            n = rng.randint(1, 9)
            before = [f"line_{case}_{i} = {rng.randint(0, 99)}" for i in range(n)]
            after = []
            for i, line in enumerate(before):
                kind = rng.choice(("keep", "keep", "change", "insert", "grow"))
                if kind == "insert":
                    after += [f"new_{case}_{i}_{k}" for k in range(rng.randint(1, 3))]
                after.append(f"changed_{case}_{i}" if kind == "change" else line)
                if kind == "grow":
                    after += [f"more_{case}_{i}_{k}" for k in range(rng.randint(1, 2))]
            if rng.random() < 0.3:
                after.append(f"tail_{case}")
            old, new = "\n".join(before) + "\n", "\n".join(after) + "\n"
            session.write_text("m.py", old)
            calls = reference_line_edits("m.py", old, new)
            assert (not calls) == (old == new)
            for c in calls:
                assert c.name == "replace_line" and 1 <= c.args["line"] <= n
                replace_line(ctx, **c.args)
            assert session.read_text("m.py") == new, (before, after, calls)
    with pytest.raises(ValueError, match="cannot delete lines"):
        reference_line_edits("m.py", "a\nb\nc\n", "a\nc\n")


def test_line_edit_demonstrations_solve_every_template_in_fewer_bytes():
    """The scripted episodes with `replace_line` pass on a task of each template (each fix but
    the helper's is one line), and every template's edits are shorter than with `edit`."""
    fmt = make_format("compact")
    tasks = [agent_family_tasks(10, seed=2, templates=[t], names="fixed")[0] for t in TEMPLATES]
    with Scorer(workers=1) as scorer:
        for task in tasks:
            env = ToolEnvironment(TOK, AgentConfig(max_turns=8, max_context_tokens=4096,
                                                   call_format="compact"), scorer=scorer)
            calls = scripted_calls(task, "replace_line")
            try:
                traj = demonstrate(env, task, calls)
            finally:
                env.close()
            assert traj.info["passed"], task.id
            lines = [fmt.render_call(c) for c in calls if c.name == "replace_line"]
            edits = [fmt.render_call(c) for c in scripted_calls(task) if c.name == "edit"]
            assert len(lines) == (2 if task.metadata["family"] == "helper" else 1)
            assert sum(map(len, lines)) < sum(map(len, edits)), (lines, edits)
    with pytest.raises(ValueError, match="edit_tool 'patch'"):
        scripted_calls(tasks[0], "patch")


def test_copy_rows_pair_each_copied_value_with_the_message_that_holds_it(played):
    for task, traj, calls, rows in played:
        reads = [c for c in calls if c.name == "read_file"]
        edits = [c for c in calls if c.name == "edit"]
        assert len(rows) == len(reads) + 2 * len(edits)
        spans = action_spans(traj.policy_mask)
        first_turn = traj.tokens[spans[0][0]:spans[1][0]]
        row = iter(rows)
        previous = traj.tokens[:traj.prompt_len]  # the first read copies from the prompt
        for k, (call, (a, _)) in enumerate(zip(calls, spans)):
            if call.name == "read_file":
                context, prefix, weights = next(row)
                assert context == previous and prefix == traj.tokens[a:a + len(prefix)]
                copied = [TOK.decode(prefix[lo:hi]) for lo, hi in _runs(weights)]
                assert copied == [call.args["path"]]
                path = call.args["path"]  # named in the prompt, or imported by the last read
                module = path.removesuffix(".py").replace("/", ".")
                assert path in TOK.decode(context) or f"from {module} import" in TOK.decode(context)
                previous = traj.tokens[a:spans[k + 1][0]]
            elif call.name == "edit":
                (view, p1, w1), (tests, p2, w2) = next(row), next(row)
                assert view == previous and tests == first_turn
                assert p1 == traj.tokens[a:a + len(p1)] and p2 == traj.tokens[a:a + len(p2)]
                escaped = [json.dumps(call.args[k])[1:-1] for k in ("path", "search", "replace")]
                assert [TOK.decode(p1[lo:hi]) for lo, hi in _runs(w1)] == escaped[:2]
                assert [TOK.decode(p2[lo:hi]) for lo, hi in _runs(w2)] == escaped[2:]
                # the line searched for is in the file's view
                assert call.args["search"].strip() in TOK.decode(view)
                # each row ends at its last copied value: no loss past it, no tokens to spare
                assert _runs(w1)[-1][1] == len(p1) and _runs(w2)[-1][1] == len(p2)
        assert next(row, None) is None


def test_copy_rows_need_the_whole_demonstration(played):
    _, traj, calls, _ = played[0]
    with pytest.raises(ValueError, match="actions for .* calls"):
        copy_rows(traj, calls[:-1], TOK, make_format("compact").render_call)


def test_path_copy_rows_name_one_made_up_path_and_weight_only_its_copy():
    render = make_format("compact").render_call
    rows = path_copy_rows(random.Random(0), 50, TOK, render)
    assert rows == path_copy_rows(random.Random(0), 50, TOK, render)  # drawn from the rng
    paths = set()
    for context, prefix, weights in rows:
        (lo, hi), = _runs(weights)
        path = TOK.decode(prefix[lo:hi])
        paths.add(path)
        assert hi == len(prefix) and TOK.decode(prefix[:lo]) == '@read_file {"path": "'
        assert TOK.decode(context).count(path) == 1 and path.endswith(".py")
        assert len(context) + len(prefix) < 130  # short rows: the point of them
    assert len(paths) == 50


def test_a_redrawn_demonstration_is_the_demonstration_of_the_redrawn_task():
    """`substitute_trajectory` with `redraw`'s mapping gives, token for token, what playing the
    script on the task with the other facts gives (so warm-up rows with redrawn facts are
    real demonstrations, never seen ones)."""
    tasks = agent_family_tasks(40, seed=3, names="fixed")
    ops = {}  # one constant task per operation (their checks differ), one of each other
    for t in tasks:
        facts = json.loads(t.metadata["facts"])
        ops.setdefault(facts.get("op", t.metadata["family"]), t)
    picked = [ops[k] for k in ("add", "min", "exception", "edge_case")]
    picked.append(agent_family_tasks(3, seed=4, templates=["exception"])[0])  # made-up names
    picked += agent_family_tasks(3, seed=3, templates=["constant_few", "edge_case_few",
                                                       "constant_keyed"])
    rng = random.Random(0)
    with Scorer(workers=1) as scorer:
        def play(task):
            env = ToolEnvironment(TOK, AgentConfig(max_turns=8, max_context_tokens=4096,
                                                   call_format="compact"), scorer=scorer)
            try:
                traj = demonstrate(env, task, scripted_calls(task))
            finally:
                env.close()
            assert traj.info["passed"], task.id
            return traj

        for task in picked:
            mapping = redraw(task, rng)
            assert any(k != v for k, v in mapping.items()), mapping
            other = dataclasses.replace(
                task, prompt=substitute(task.prompt, mapping),
                files={p: substitute(c, mapping) for p, c in task.files.items()},
                metadata={**task.metadata,
                          "reference": json.dumps({p: substitute(c, mapping) for p, c in json.loads(
                              task.metadata["reference"]).items()})})
            want, got = play(other), substitute_trajectory(play(task), mapping, TOK)
            assert TOK.decode(got.tokens) == TOK.decode(want.tokens)
            assert (got.tokens, got.policy_mask, got.prompt_len) == (
                want.tokens, want.policy_mask, want.prompt_len), task.id
            # the facts the actions copy: each flagged run spells a new value, inside an action
            facts = fact_tokens(got, mapping, TOK)
            assert all(got.policy_mask[i] for i, f in enumerate(facts) if f)
            runs = [TOK.decode(got.tokens[a:b]) for a, b in action_spans(facts)]
            assert runs and set(runs) <= set(mapping.values()), (runs, mapping)
    assert redraw(agent_family_tasks(2, templates=["helper"])[0], rng) == {}


def test_a_scripted_start_is_the_demonstration_s_prefix_as_prompt_and_its_rest_still_passes(played):
    """An episode started after the script's calls up to its first edit (the reverse
    curriculum's start state): the calls and their observations are prompt, token for token,
    out of the policy mask; the script's remaining calls, played from there, earn 1.0 and make
    the whole demonstration again."""
    task, demo, calls, _ = played[1]  # two reads: three calls before the edit
    k = next(i for i, c in enumerate(calls) if c.name == "edit")
    assert k == 3
    fmt = make_format("compact")
    with Scorer(workers=1) as scorer:
        env = ToolEnvironment(TOK, AgentConfig(max_turns=8, max_context_tokens=4096,
                                               call_format="compact"), scorer=scorer)
        traj = scripted_start(env, task, calls[:k], version=7)
        assert not traj.done and traj.version == 7 and traj.info["prefix_calls"] == k
        assert traj.info["turns"] == k  # the scripted calls count against max_turns
        assert traj.prompt_len == len(traj.tokens) and not any(traj.policy_mask)
        assert traj.tokens == demo.tokens[:len(traj.tokens)] and not any(traj.logprobs)
        for call in calls[k:]:
            action = TOK.encode(fmt.render_call(call)) + [TOK.eos_id]
            traj.add_action(action, [-0.5] * len(action))
            traj.record(env.step(action))
        env.close()
    assert traj.done and traj.reward == 1.0 and traj.info["passed"]
    assert traj.tokens == demo.tokens
    n = traj.prompt_len
    assert traj.policy_mask == [False] * n + demo.policy_mask[n:] and any(traj.policy_mask)


# the templates whose facts `redraw` draws afresh (their fact shows only in the test output)
FACT_TEMPLATES = ("constant", "exception", "edge_case")


def _right(task) -> str:
    """The text of the fact a task's fix writes (a value, an error's name, a default)."""
    facts = json.loads(task.metadata["facts"])
    return str(next(facts[k] for k in ("value", "error", "default") if k in facts))


def _play(scorer, task, calls):
    env = ToolEnvironment(TOK, AgentConfig(max_turns=len(calls), max_context_tokens=4096,
                                           call_format="compact"), scorer=scorer)
    try:
        return demonstrate(env, task, calls)
    finally:
        env.close()


@pytest.fixture(scope="module")
def recovered():
    """A recovery demonstration (`edit`) of each template with facts (made-up names)."""
    tasks = agent_family_tasks(3, seed=11, templates=FACT_TEMPLATES)
    out = []
    with Scorer(workers=1) as scorer:
        for task in tasks:
            calls, wrong = recovery_calls(task)
            out.append((task, calls, wrong, _play(scorer, task, calls)))
    return out


def test_a_recovery_demonstration_fails_once_shows_the_fact_again_then_passes(recovered):
    """The wrong edit (the blind guess) is followed by a failing run whose output holds the
    right value; the fix writes it, and the episode earns 1.0."""
    assert [t.metadata["family"] for t, *_ in recovered] == list(FACT_TEMPLATES)
    for task, calls, wrong, traj in recovered:
        assert traj.done and traj.reward == 1.0 and traj.info["passed"], task.id
        assert [c.name for c in calls] == ["run_tests", "read_file", "edit", "run_tests", "edit",
                                           "run_tests", "finish"] and wrong == [2]
        right = whole([_right(task)])
        guess, fix = calls[2].args["replace"], calls[4].args["replace"]
        assert not right.search(guess) and right.search(fix), (guess, fix)
        spans = action_spans(traj.policy_mask)
        failed = TOK.decode(traj.tokens[spans[3][1]:spans[4][0]])  # after the wrong edit's run
        assert "1 failed" in failed and right.search(failed), failed


def test_a_recovery_with_replace_line_fixes_the_line_the_wrong_edit_wrote():
    for task in agent_family_tasks(3, seed=11, templates=FACT_TEMPLATES):
        calls, wrong = recovery_calls(task, "replace_line")
        guesses = [calls[k] for k in wrong]
        fixes = [c for c in calls[wrong[-1] + 2:] if c.name == "replace_line"]
        assert [c.args["line"] for c in fixes] == [c.args["line"] for c in guesses], task.id
        assert [c.args["text"] for c in fixes] != [c.args["text"] for c in guesses]


def test_a_recovery_needs_a_blind_guess_that_is_wrong():
    task = agent_family_tasks(1, seed=11)[0]
    for blind in (task.metadata["reference"], json.dumps(task.files)):
        with pytest.raises(ValueError, match=r"metadata\['blind'\] must change files"):
            recovery_calls(dataclasses.replace(task, metadata={**task.metadata, "blind": blind}))
    with pytest.raises(ValueError, match=r"metadata\['blind'\] holds no files"):
        recovery_calls(dataclasses.replace(task, metadata={**task.metadata, "blind": ""}))


def test_without_actions_takes_the_numbered_actions_out_of_the_mask():
    mask = [False, True, True, False, True, False, False, True, True, True]
    assert without_actions(mask, [1]) == [False, True, True, False, False, False, False,
                                          True, True, True]
    assert without_actions(mask, [0, 2]) == [False] * 4 + [True] + [False] * 5
    assert without_actions(mask, []) == mask


def test_a_redrawn_recovery_keeps_its_guess_wrong_and_is_the_redrawn_task_s_recovery(recovered):
    """`redraw_recovery` never makes the wrong edit right (where `redraw` alone can), and
    the substituted recovery demonstration is token for token the one played on the redrawn
    task."""
    task, _, _, traj = recovered[0]  # constant: a redrawn value can meet the guess's
    reference, blind = (json.loads(task.metadata[k]) for k in ("reference", "blind"))
    (path, guess), = blind.items()
    rng = random.Random(0)
    collides = [substitute(guess, m) == substitute(reference[path], m)
                for m in (redraw(task, rng) for _ in range(2000))]
    assert any(collides)  # so the check below can fail
    draws = [redraw_recovery(task, rng) for _ in range(2000)]
    assert all(substitute(guess, m) not in (substitute(reference[path], m),
                                            substitute(task.files[path], m)) for m in draws)
    mapping = draws[0]
    assert any(k != v for k, v in mapping.items()), mapping
    other = dataclasses.replace(
        task, prompt=substitute(task.prompt, mapping),
        files={p: substitute(c, mapping) for p, c in task.files.items()},
        metadata={**task.metadata, **{k: json.dumps({p: substitute(c, mapping) for p, c in
                                                     json.loads(task.metadata[k]).items()})
                                      for k in ("reference", "blind")}})
    with Scorer(workers=1) as scorer:
        want = _play(scorer, other, recovery_calls(other)[0])
    got = substitute_trajectory(traj, mapping, TOK)
    assert want.reward == 1.0
    assert (got.tokens, got.policy_mask, got.prompt_len) == (
        want.tokens, want.policy_mask, want.prompt_len)


def test_next_scripted_call_follows_the_calls_that_ran_through_the_script():
    run, fin = ToolCall("run_tests", {}), ToolCall("finish", {})
    read = ToolCall("read_file", {"path": "app/_core.py"})
    fix = ToolCall("replace_line", {"path": "app/_core.py", "line": 3, "text": "LIMIT = 76"})
    wrong = ToolCall("replace_line", {"path": "app/_core.py", "line": 3, "text": "LIMIT = 7"})
    script = [run, read, fix, run, fin]
    for ran, want in [([], run), ([run], read), ([run, read], fix),
                      ([run, read, wrong, run], fix),  # a wrong edit leaves the fix to come
                      ([read], run),  # the tests first, as the script does
                      ([run, run, read, fix], run), ([run, read, fix, run], fin),
                      ([run, read, fix, run, run, run], fin)]:
        assert next_scripted_call(script, ran) == want, ran


def test_scripted_corrections_name_the_scripts_next_call_at_each_flagged_turn():
    """A played episode (run the tests, a malformed call, the read, another malformed call,
    the read again): the teacher's turn at the first bad call is the read, at the second the
    fix, token for token as a demonstration writes them."""
    task = agent_family_tasks(3, seed=5, templates=["constant_keyed"])[0]
    fmt = make_format("compact")
    script = scripted_calls(task, "replace_line")
    run, read, fix = script[:3]
    assert (run.name, read.name, fix.name) == ("run_tests", "read_file", "replace_line")
    actions = [fmt.render_call(run), "@ruoreste_t", fmt.render_call(read),
               '@readelele {"pat.p/cen_te', fmt.render_call(read)]

    def play(prefix, texts):
        env = ToolEnvironment(TOK, AgentConfig(max_turns=8, max_context_tokens=4096,
                                               call_format="compact"), scorer=scorer)
        try:
            traj = scripted_start(env, task, prefix, version=0)
            for text in texts:
                action = TOK.encode(text) + list(TOK.stop_ids[:1])
                traj.add_action(action, [0.0] * len(action))
                traj.record(env.step(action))
        finally:
            env.close()
        return traj

    def tokens(*calls):
        return [TOK.encode(fmt.render_call(c)) + list(TOK.stop_ids[:1]) for c in calls]

    with Scorer(workers=1) as scorer:
        traj = play([], actions)
        # after the scripted calls an episode started with (a reverse curriculum) and a read
        started = play([run], ["@ruoreste_t", fmt.render_call(read), "@finis"])
    flagged = flagged_turns(traj, ["bad_tool_call"])
    spans = action_spans(traj.policy_mask)
    assert [(a, b) for a, b, _ in flagged] == [spans[1], spans[3]]
    corrections = scripted_corrections(traj, task, flagged, fmt, TOK, "replace_line")
    assert corrections == tokens(read, fix)
    flagged = flagged_turns(started, ["bad_tool_call"])
    assert len(flagged) == 2
    assert scripted_corrections(started, task, flagged, fmt, TOK, "replace_line",
                                prefix=[run]) == tokens(read, fix)
    with pytest.raises(ValueError, match="holds no files to demonstrate"):
        scripted_corrections(traj, dataclasses.replace(task, metadata={}), flagged, fmt, TOK)
