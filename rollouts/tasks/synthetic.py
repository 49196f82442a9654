"""The embedded synthetic task family the default (tiny, byte-level) RL run learns on.

Prompts are a one-line docstring; reference programs are a single expression
(`x+3`, `s[::-1]`), so a model with a few M parameters can learn them on CPU.
Generation is deterministic per seed.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollouts.sandbox.types import TestCase
from rollouts.tasks.task import Task

_N_TESTS = 4


@dataclass(frozen=True)
class _Family:
    """A template: draw constants, then describe, implement and sample inputs."""

    arg: str  # "x" (int) or "s" (str)
    draw: Callable[[random.Random], tuple[int, ...]]
    describe: Callable[[tuple[int, ...]], str]
    expression: Callable[[tuple[int, ...]], str]


def _k(lo: int, hi: int) -> Callable[[random.Random], tuple[int, ...]]:
    return lambda rng: (rng.randint(lo, hi),)


FAMILIES: dict[str, _Family] = {
    "add": _Family("x", _k(1, 9), lambda k: f"x plus {k[0]}", lambda k: f"x+{k[0]}"),
    "sub": _Family("x", _k(1, 9), lambda k: f"x minus {k[0]}", lambda k: f"x-{k[0]}"),
    "mul": _Family("x", _k(2, 9), lambda k: f"x times {k[0]}", lambda k: f"x*{k[0]}"),
    "mod": _Family("x", _k(2, 9), lambda k: f"x mod {k[0]}", lambda k: f"x%{k[0]}"),
    "affine": _Family(
        "x",
        lambda rng: (rng.randint(2, 5), rng.randint(1, 9)),
        lambda k: f"{k[0]} times x plus {k[1]}",
        lambda k: f"{k[0]}*x+{k[1]}",
    ),
    "reverse": _Family(
        "s", lambda rng: (), lambda k: "s reversed", lambda k: "s[::-1]"
    ),
    "upper": _Family(
        "s", lambda rng: (), lambda k: "s in upper case", lambda k: "s.upper()"
    ),
    "repeat": _Family(
        "s", _k(2, 4), lambda k: f"s repeated {k[0]} times", lambda k: f"s*{k[0]}"
    ),
    "prefix": _Family(
        "s", _k(1, 3), lambda k: f"first {k[0]} chars of s", lambda k: f"s[:{k[0]}]"
    ),
    "double_last": _Family(
        "s", lambda rng: (), lambda k: "s plus its last char", lambda k: "s+s[-1:]"
    ),
}


def _inputs(arg: str, rng: random.Random) -> list:
    if arg == "x":
        return rng.sample(range(-20, 50), _N_TESTS)
    return [
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 6)))
        for _ in range(_N_TESTS)
    ]


def synthetic_tasks(
    n: int, seed: int = 0, families: Sequence[str] | None = None
) -> list[Task]:
    """n tasks drawn from `families` (default: all); `metadata["reference"]` passes."""
    names = list(families or FAMILIES)
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        raise ValueError(
            f"unknown synthetic families {unknown}; known: {', '.join(FAMILIES)}"
        )
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        name = rng.choice(names)
        fam = FAMILIES[name]
        consts = fam.draw(rng)
        expr = fam.expression(consts)
        fn = eval(f"lambda {fam.arg}: {expr}")  # our own template, never model output
        inputs = _inputs(fam.arg, rng)
        while len({repr(fn(v)) for v in inputs}) < 2:  # a constant answer must not pass
            inputs = _inputs(fam.arg, rng)
        tests = tuple(
            TestCase(
                f"synthetic/{seed}/{i}#{j}", f"assert candidate({v!r}) == {fn(v)!r}"
            )
            for j, v in enumerate(inputs)
        )
        tasks.append(
            Task(
                id=f"synthetic/{seed}/{i}",
                prompt=f'def f({fam.arg}):\n    """{fam.describe(consts)}"""\n    return ',
                entry_point="f",
                tests=tests,
                completion_mode="continue",
                metadata={"reference": f"{expr}\n", "family": name, "seed": seed},
            )
        )
    return tasks
