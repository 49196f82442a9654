"""An embedded family of small repository tasks that need tools: the prompt alone is not enough.

Each template writes a tiny package (a few short files) whose tests fail, with a prompt that
states the behaviour incompletely:

  constant    a module constant has the wrong value; the right one shows only in the failing
              test output (`assert 12 == 37`)
  exception   bad input raises ValueError but must raise one of several package errors; which
              one shows only in the failing test output (`pytest.raises(errors.QuotaError)`)
  helper      a function must reuse a helper the prompt does not name, in a file it does not
              show: found with `search` or `read_file`
  hidden_file the bug sits in a module the prompt does not mention (reached by reading the
              function's imports), and the expected output shows only in the test output
  edge_case   an empty input gives None but must give a fixed default; which one shows only in
              the failing test output (`assert largest_item([]) == -7`)

Few-valued variants (`constant_few`, `edge_case_few`; drawn only by name): the same tasks with
the value drawn from eight (`_FEW`), as the exception's class is, and the constant's wrong value
never one of them. The tiny byte model copied neither the digits drawn from 90 values nor, in a
700-step warm-up, the same digits after the text the edit writes before them (`LIMIT = 37` in
the test; git ec723da, docs/agent.md, fifteenth session), while it learnt the exception's class:
one of eight names, the only one in the context. These variants ask for that recognition, not a
copy of arbitrary digits.

Keyed variants (`constant_keyed`, `hidden_file_keyed`; drawn only by name): the failing
assertion's message names the fact as the edit writes it, beside the name the edited line
starts with (`"CAP should be 37"`, `"SEP should be '/'"`), never the edited line itself. The
few-valued constant (held-out 0.05, its first digit guessed from a prior) and the separator
between the expected string's digits (right in 14 of 112 held-out episodes, chance) did not move
in warm-up or in RL
(docs/agent.md, seventeenth and eighteenth sessions); these ask for the exception's kind of
copy, a span after a key, and the constant's value is one of the eight.

Names and constants are drawn per task, so tasks vary; generation is deterministic per seed.
Package and module names are made up per task (`names="made_up"`: paths must be copied from
what was read, not recalled) or the same in every task (`names="fixed"`: `app/core.py`, so the
copies left are the facts and the lines to edit: the easier set a small model learns first).
`metadata["reference"]` is a JSON {path: new content} that passes, `metadata["reads"]` the
files a solver reads, in order (JSON list); no file and not the prompt hold a changed line of
the reference (`answer_leaks`). Graded like the feature-deletion tasks: `python -m pytest tests`
with edits under `tests` discarded. `agent_task_splits` holds out a fixed fifth of all task
contents (by hash), so held-out tasks are never trained on.
"""

from __future__ import annotations

import functools
import itertools
import json
import keyword
import random
import re
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence

from rollouts.tasks.task import Task

TEST_COMMAND = ("python", "-m", "pytest", "tests")
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
_NOUNS = ("item", "order", "seat", "page", "crate", "ticket", "slot", "batch", "coin", "entry")
_CONSTS = ("LIMIT", "CAP", "OFFSET", "FLOOR", "BONUS", "QUOTA", "MARGIN", "BASE")
_ERRORS = ("QuotaError", "RangeError", "InputError", "LimitError", "FormatError", "StateError",
           "BudgetError", "OrderError")
_HELPERS = ("canon", "normalize", "tidy", "clean_key", "slug", "as_key", "squash", "fold")
_SEPS = (", ", "; ", " | ", "/", " + ", "-", ":", " ")
# (wrong-looking char, replacement) pairs a helper applies after strip + case change
_SWAPS = ((" ", "_"), ("-", "_"), (" ", "-"), ("_", "."), ("-", " "), (".", "_"))
# the few-valued variants' facts: eight each, no two with the same first digit, so the first
# digit names the value (-2 beside -27 was read as -27: docs/agent.md, sixteenth session)
_FEW = {"constant": (12, 25, 37, 41, 58, 63, 76, 89),
        "edge_case": (-3, -5, -9, -13, -27, -44, -61, -86)}


def made_up_word(rng: random.Random, syllables: int) -> str:
    """A made-up lower-case name (`kavo`, `midune`): drawn per task from 70^2 = 4,900 (two
    syllables) or 70^3 = 343,000 (three), so a policy must copy paths from what it read rather
    than recall the few a fixed list would give; never a keyword or a standard-library module,
    which a package of that name would shadow."""
    while True:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if not keyword.iskeyword(word) and word not in sys.stdlib_module_names:
            return word


def _place(rng: random.Random, names: str) -> tuple[str, str]:
    """(package, module) names of a task."""
    made_up = made_up_word(rng, 3), made_up_word(rng, 2)  # drawn either way: same other draws
    return made_up if names == "made_up" else ("app", "core")


def _fn(rng: random.Random, verb: Sequence[str]) -> str:
    return f"{rng.choice(verb)}_{rng.choice(_NOUNS)}"


def _constant(rng: random.Random, names: str, few: bool = False, keyed: bool = False) -> dict:
    (pkg, mod), const = _place(rng, names), rng.choice(_CONSTS)
    fn = _fn(rng, ("cap", "bound", "adjust", "shift"))
    op = rng.choice(("min", "max", "add"))
    if few:
        value, wrong = _few_constant(rng)
    else:
        value = rng.randint(10, 99)
        wrong = rng.choice([v for v in range(10, 100) if v != value])
    body, how, checks = {
        "min": (f"min(x, {const})", f"capped at {const}", [(1000, value), (3, 3)]),
        "max": (f"max(x, {const})", f"at least {const}", [(-1000, value), (1000, 1000)]),
        "add": (f"x + {const}", f"plus {const}", [(0, value), (5, value + 5)]),
    }[op]
    path = f"{pkg}/{mod}.py"
    source = (f'"""{mod.capitalize()} of the {pkg} package."""\n\n{const} = {{}}\n\n\n'
              f"def {fn}(x):\n    \"\"\"x {how}.\"\"\"\n    return {body}\n")
    # keyed: the failing check's message names the constant beside its value
    said = f', "{const} should be {value}"' if keyed else ""
    test = (f"from {pkg}.{mod} import {fn}\n\n\ndef test_{fn}():\n"
            + "".join(f"    assert {fn}({a}) == {b}{said if i == 0 else ''}\n"
                      for i, (a, b) in enumerate(checks)))
    prompt = (f"`{fn}(x)` in {path} returns x {how}, but {const} has the wrong value. The right "
              f"value is not written here. Fix {const} so the tests pass.")
    return {"files": {f"{pkg}/__init__.py": "", path: source.format(wrong),
                      f"tests/test_{mod}.py": test},
            "reference": {path: source.format(value)}, "prompt": prompt,
            "facts": {"const": const, "wrong": wrong, "value": value, "op": op},
            # a blind guess from the prompt alone: some other value
            "blind": {path: source.format(wrong + 1 if wrong + 1 != value else wrong + 2)}}


def _few_constant(rng: random.Random) -> tuple[int, int]:
    """(value, wrong) of a few-valued constant: the wrong value is never one of the eight."""
    return rng.choice(_FEW["constant"]), rng.choice(
        [v for v in range(10, 100) if v not in _FEW["constant"]])


def _exception(rng: random.Random, names: str) -> dict:
    pkg, mod = _place(rng, names)
    fn = _fn(rng, ("reserve", "book", "take", "claim"))
    errors = rng.sample(_ERRORS, 4)
    err, k = rng.choice(errors), rng.randint(2, 9)
    classes = "".join(f"\n\nclass {e}(Exception):\n    pass\n" for e in errors)
    path = f"{pkg}/{mod}.py"
    # the rate in a constant of its own: the line an edit anchors on holds no drawn value
    head = (f'"""{mod.capitalize()} of the {pkg} package."""\n\nfrom {pkg} import errors\n\n'
            f"RATE = {k}\n\n\ndef {fn}(n):\n    \"\"\"RATE units per n; a negative n raises one "
            "of the package's errors.\"\"\"\n")
    # the check is there but raises the wrong error: the fix is one line, the error's name
    check = "    if n < 0:\n        raise {}(n)\n    return n * RATE\n"
    test = (f"import pytest\n\nfrom {pkg} import errors\nfrom {pkg}.{mod} import {fn}\n\n\n"
            f"def test_{fn}():\n    assert {fn}(2) == {2 * k}\n"
            f"    with pytest.raises(errors.{err}):\n        {fn}(-1)\n")
    prompt = (f"`{fn}(n)` in {path} must refuse a negative n by raising one of the errors of "
              f"{pkg}/errors.py, not ValueError; the tests say which. Make the tests pass.")
    return {"files": {f"{pkg}/__init__.py": "", f"{pkg}/errors.py": f'"""Errors."""\n{classes}',
                      path: head + check.format("ValueError"), f"tests/test_{mod}.py": test},
            "reference": {path: head + check.format(f"errors.{err}")},
            "prompt": prompt, "facts": {"error": err, "errors": errors, "k": k},
            # a guess from the prompt alone: the package's next error
            "blind": {path: head + check.format(
                f"errors.{errors[(errors.index(err) + 1) % len(errors)]}")}}


def _helper(rng: random.Random, names: str) -> dict:
    (pkg, mod), hmod = _place(rng, names), rng.choice(("text", "keys"))
    fn = _fn(rng, ("keys_for", "index", "label"))
    helper, decoy = rng.sample(_HELPERS, 2)
    case = rng.choice(("lower", "upper"))
    old, new = rng.choice(_SWAPS)
    word = rng.choice(_NOUNS)
    raw = f" {word.capitalize()}{old}{rng.choice(_NOUNS)} "
    want = raw.strip()
    want = (want.lower() if case == "lower" else want.upper()).replace(old, new)
    helpers = (f'"""Helpers shared by the {pkg} package."""\n\n\n'
               f"def {decoy}(s):\n    \"\"\"s without surrounding spaces.\"\"\"\n    return s.strip()\n\n\n"
               f"def {helper}(s):\n    \"\"\"The canonical key of a name.\"\"\"\n"
               f"    return s.strip().{case}().replace({old!r}, {new!r})\n")
    path = f"{pkg}/{mod}.py"
    head = f'"""{mod.capitalize()} of the {pkg} package."""\n'
    body = (f"\n\ndef {fn}(names):\n    \"\"\"The canonical key of each name.\"\"\"\n"
            "    return [{}]\n")
    test = (f"from {pkg}.{mod} import {fn}\n\n\ndef test_{fn}():\n"
            f"    assert {fn}([{raw!r}]) == [{want!r}]\n")
    prompt = (f"`{fn}(names)` in {path} must return the canonical key of each name. The package "
              "already has a helper that makes canonical keys: find it and reuse it.")
    return {"files": {f"{pkg}/__init__.py": "", f"{pkg}/{hmod}.py": helpers,
                      path: head + body.format("n for n in names"),
                      f"tests/test_{mod}.py": test},
            "reference": {path: f"{head}\nfrom {pkg}.{hmod} import {helper}\n"
                                + body.format(f"{helper}(n) for n in names")},
            "prompt": prompt,
            "blind": {path: head + body.format("n.strip().lower() for n in names")}}


def _hidden_file(rng: random.Random, names: str, keyed: bool = False) -> dict:
    pkg, mod = _place(rng, names)
    low = rng.choice(("fmt", "render", "layout", "join"))
    fn, joiner = _fn(rng, ("summary", "line", "show")), rng.choice(("join_all", "glue", "concat"))
    sep, wrong = rng.sample(_SEPS, 2)
    items = rng.sample(range(1, 10), 3)
    api = (f'"""{mod.capitalize()} of the {pkg} package."""\n\n'
           f"from {pkg}._{low} import {joiner}\n\n\n"
           f"def {fn}(items):\n    \"\"\"The items on one line.\"\"\"\n"
           f"    return {joiner}(str(i) for i in items)\n")
    low_src = (f'"""Formatting."""\n\nSEP = {{!r}}\n\n\n'
               f"def {joiner}(parts):\n    return SEP.join(parts)\n")
    test = (f"from {pkg}.{mod} import {fn}\n\n\ndef test_{fn}():\n"
            f"    assert {fn}({items!r}) == {sep.join(map(str, items))!r}"
            + (f', "SEP should be {sep!r}"' if keyed else "") + "\n")
    prompt = (f"`{fn}(items)` in {pkg}/{mod}.py puts the wrong separator between the items. "
              "Make the tests pass.")
    return {"files": {f"{pkg}/__init__.py": "", f"{pkg}/{mod}.py": api,
                      f"{pkg}/_{low}.py": low_src.format(wrong), f"tests/test_{mod}.py": test},
            "reference": {f"{pkg}/_{low}.py": low_src.format(sep)}, "prompt": prompt,
            # the module to edit is found through the imports of the one the prompt names
            "reads": [f"{pkg}/{mod}.py", f"{pkg}/_{low}.py"],
            # the prompt names no separator: a guess
            "blind": {f"{pkg}/_{low}.py": low_src.format(rng.choice(
                [s for s in _SEPS if s not in (sep, wrong)]))}}


def _edge_case(rng: random.Random, names: str, few: bool = False) -> dict:
    pkg, mod = _place(rng, names)
    fn = _fn(rng, ("largest", "smallest", "top"))
    pick = "min" if fn.startswith("smallest") else "max"
    default = rng.choice(_FEW["edge_case"]) if few else rng.randint(-99, -1)
    xs = rng.sample(range(1, 50), 3)
    path = f"{pkg}/{mod}.py"
    doc = (f"    \"\"\"The {'smallest' if pick == 'min' else 'largest'} of xs; "
           "an empty xs gives a fixed default.\"\"\"\n")
    # an empty xs gives None today: the fix is one line, the default's value
    source = (f'"""{mod.capitalize()} of the {pkg} package."""\n\n\n'
              f"def {fn}(xs):\n{doc}    return {pick}(xs) if xs else {{}}\n")
    test = (f"from {pkg}.{mod} import {fn}\n\n\ndef test_{fn}():\n"
            f"    assert {fn}({xs!r}) == {min(xs) if pick == 'min' else max(xs)}\n"
            f"    assert {fn}([]) == {default}\n")
    prompt = (f"`{fn}(xs)` in {path} returns None for an empty list; it must return a fixed "
              "default there, which the tests give. Make the tests pass.")
    return {"files": {f"{pkg}/__init__.py": "", path: source.format(None),
                      f"tests/test_{mod}.py": test},
            "reference": {path: source.format(default)},
            "prompt": prompt, "facts": {"default": default},
            "blind": {path: source.format(0)}}


TEMPLATES: dict[str, Callable[[random.Random, str], dict]] = {
    "constant": _constant, "exception": _exception, "helper": _helper,
    "hidden_file": _hidden_file, "edge_case": _edge_case,
    "constant_few": functools.partial(_constant, few=True),
    "edge_case_few": functools.partial(_edge_case, few=True),
    "constant_keyed": functools.partial(_constant, few=True, keyed=True),
    "hidden_file_keyed": functools.partial(_hidden_file, keyed=True),
}
# What `templates=None` draws: the few-valued variants are chosen by name.
DEFAULT_TEMPLATES = ("constant", "exception", "helper", "hidden_file", "edge_case")
# Where the missing fact is only in the test output: a blind edit from the prompt cannot pass.
FACT_IN_TEST_OUTPUT = ("constant", "exception", "hidden_file", "edge_case", "constant_few",
                       "edge_case_few", "constant_keyed", "hidden_file_keyed")
_SUFFIX = "\n\nDo not edit the tests (edits to them are discarded). Call finish when done.\n"


def answer_leaks(task: Task) -> list[str]:
    """Where a line the reference adds or changes already appears (a file of the task, or its
    prompt): `path: line`. Empty for a task that holds no copy of its answer."""
    reference = json.loads(task.metadata["reference"])
    texts = {**{p: c for p, c in task.files.items() if isinstance(c, str)},
             "the task's prompt": task.prompt}
    out = []
    for path, new in reference.items():
        old = set(str(task.files.get(path, "")).splitlines())
        for line in new.splitlines():
            key = line.strip()
            if key and line not in old and any(key in text for text in texts.values()):
                out.append(f"{path}: {key}")
    return out


def redraw(task: Task, rng: random.Random) -> dict[str, str]:
    """Another draw of the task's facts (the values a solver must find in the test output), as
    {old text: new text}: `substitute` with it turns the task's prompt, files and reference, and
    any episode played on the task, into those of the other draw (tests replay both). So a
    warm-up can show one demonstration with facts it has not seen, which a model can only get
    right by copying them from the context. Empty for the templates without such facts
    (`helper`, `hidden_file`) and for a task whose facts' texts coincide."""
    facts, family = json.loads(task.metadata.get("facts", "{}")), task.metadata["family"]
    few = family.endswith(("_few", "_keyed"))  # a keyed constant is few-valued
    family = family.removesuffix("_few").removesuffix("_keyed")
    if family == "constant":
        old = [facts["const"], str(facts["wrong"]), str(facts["value"])]
        value, wrong = _few_constant(rng) if few else rng.sample(range(10, 100), 2)
        new = [rng.choice(_CONSTS), str(wrong), str(value)]
        if facts["op"] == "add":  # the second check's expected value
            old.append(str(facts["value"] + 5))
            new.append(str(value + 5))
    elif family == "exception":
        err, k, k2 = facts["error"], facts["k"], rng.randint(2, 9)
        # the new error stays distinct from the other classes of errors.py
        others = set(facts["errors"]) - {err}
        old = [err, f"RATE = {k}", f"== {2 * k}"]
        new = [rng.choice([e for e in _ERRORS if e not in others]), f"RATE = {k2}",
               f"== {2 * k2}"]
    elif family == "edge_case":
        default = rng.choice(_FEW["edge_case"]) if few else rng.randint(-99, -1)
        old, new = [str(facts["default"])], [str(default)]
    else:
        return {}
    if len(set(old)) < len(old) or len(set(new)) < len(new):
        return {}
    return dict(zip(old, new))


def whole(texts) -> re.Pattern:
    """Whole occurrences of any of `texts`: not inside a longer word or number (`65` in `1650`,
    `-7` in `1-7`), the longest first."""
    keys = sorted(texts, key=len, reverse=True)
    return re.compile(r"(?<![\w-])(?:" + "|".join(map(re.escape, keys)) + r")(?!\w)")


def substitute(text: str, mapping: dict[str, str]) -> str:
    """`text` with every whole occurrence of a key of `mapping` replaced by its value, all at
    once."""
    if not mapping:
        return text
    return whole(mapping).sub(lambda m: mapping[m.group(0)], text)


def _held_out(key: str) -> bool:
    return zlib.crc32(key.encode()) % 5 == 0


NAMES = ("made_up", "fixed")


def agent_family_tasks(n: int, seed: int = 0, templates: Sequence[str] | None = None,
                       names: str = "made_up") -> list[Task]:
    """n tasks, templates in turn (default: all), drawn from `seed`; the first n of a longer
    list. `metadata`: reference (JSON {path: content} that passes), blind (what an edit from
    the prompt alone would write: it fails), reads (JSON list: the files a solver reads, in
    order, from the one the prompt names to the ones it edits), family, split_key (the drawn
    content: equal keys,
    equal tasks)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(itertools.islice(_generate(seed, templates, names), n))


def _generate(seed: int, templates: Sequence[str] | None, names: str) -> Iterator[Task]:
    kinds = list(templates or DEFAULT_TEMPLATES)
    unknown = [t for t in kinds if t not in TEMPLATES]
    if unknown:
        raise ValueError(f"unknown agent task templates {unknown}; known: {', '.join(TEMPLATES)}")
    if names not in NAMES:
        raise ValueError(f"unknown agent task names {names!r}; known: {', '.join(NAMES)}")
    rng = random.Random(f"agent-family/{seed}")
    for i in itertools.count():
        name = kinds[i % len(kinds)]
        made = TEMPLATES[name](rng, names)
        task_id = f"agent/{seed}/{i}-{name}"
        yield Task(
            id=task_id, prompt=made["prompt"] + _SUFFIX, entry_point="", tests=(),
            files=made["files"], repo=f"embedded:{task_id}", test_command=TEST_COMMAND,
            completion_mode="full",
            metadata={"test_paths": ["tests"], "grading": "isolated", "family": name,
                      "repo_key": task_id, "reference": json.dumps(made["reference"]),
                      "blind": json.dumps(made["blind"]),
                      "reads": json.dumps(made.get("reads", sorted(made["reference"]))),
                      "facts": json.dumps(made.get("facts", {})),
                      "split_key": json.dumps([name, made["files"], made["prompt"]],
                                              sort_keys=True)})


def agent_task_splits(num_train: int, num_eval: int, seed: int = 0,
                      templates: Sequence[str] | None = None,
                      names: str = "made_up") -> tuple[list[Task], list[Task]]:
    """(train, held-out) tasks: a fixed fifth of all task contents (by hash) is held out, so no
    held-out task is ever trained on; the held-out ones come from a disjoint seed."""
    train = [t for t in agent_family_tasks(num_train, seed, templates, names)
             if not _held_out(t.metadata["split_key"])]
    return train, list(itertools.islice(_held_out_draws(seed, templates, names), num_eval))


def validation_tasks(num: int, num_eval: int, seed: int = 0,
                     templates: Sequence[str] | None = None,
                     names: str = "made_up") -> list[Task]:
    """`num` held-out tasks that are not among `agent_task_splits`' `num_eval` held-out ones
    (those that follow them): never trained on, and apart from the tasks a run is evaluated
    on, so a warm-up may be watched (or stopped) on them."""
    return list(itertools.islice(_held_out_draws(seed, templates, names), num_eval,
                                 num_eval + num))


def _held_out_draws(seed: int, templates: Sequence[str] | None, names: str) -> Iterator[Task]:
    # the held-out tasks of another seed (a fifth of its draws, so a slice of them ends)
    return (t for t in _generate(seed + 10_000, templates, names)
            if _held_out(t.metadata["split_key"]))


def parse_spec(spec: str) -> tuple[int, int] | None:
    """`embedded:N[:SEED]` -> (N, SEED); None for any other `agent.tasks` value."""
    if not spec.startswith("embedded:"):
        return None
    parts = spec.split(":")[1:]
    try:
        n, seed = int(parts[0]), (int(parts[1]) if len(parts) > 1 else 0)
    except (ValueError, IndexError):
        raise ValueError(f"bad agent task set {spec!r}: expected embedded:N[:SEED] with "
                         "integers") from None
    if len(parts) > 2 or n < 1:
        raise ValueError(f"bad agent task set {spec!r}: expected embedded:N[:SEED], N >= 1")
    return n, seed
