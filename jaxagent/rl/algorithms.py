"""`rl.algorithm` as explicit settings: one preset table, expanded once, at config validation.

Each algorithm is a choice of the settings below, written as its difference from GRPO:

    grpo     (r - mean) / std over the group, token-mean loss       (arXiv 2402.03300)
    dr_grpo  r - mean (no std), each sequence's token sum over a constant length
                                                                     (arXiv 2503.20783)
    rloo     r minus the mean of the group's other members           (arXiv 2402.14740)
    dapo     grpo + clip-higher + dynamic sampling (groups without signal dropped)
                                                                     (arXiv 2503.14476)

A setting the user gives explicitly wins over the preset (`rl.algorithm: dapo` with
`rl.clip_high: 0.3` is DAPO with a wider upper clip). DAPO's overlong shaping
(`rl.overlong_buffer`) is no preset setting: its size is relative to the response budget, so
it is off unless set, and then applies with any algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping

_GRPO = {
    "baseline": "mean",  # or "leave_one_out": each member against the others' mean
    "normalize_std": True,  # divide by the group's (population) std
    "clip_low": 0.2,  # PPO ratio clip: [1 - clip_low, 1 + clip_high]
    "clip_high": 0.2,
    "aggregation": "token-mean",  # a key of jaxagent.rl.AGGREGATIONS
    "drop_zero_variance_groups": False,  # DAPO's dynamic sampling filter
}

PRESETS: dict[str, dict[str, object]] = {
    "grpo": _GRPO,
    "dr_grpo": {**_GRPO, "normalize_std": False, "aggregation": "seq-mean-token-sum-norm"},
    "rloo": {**_GRPO, "baseline": "leave_one_out", "normalize_std": False},
    "dapo": {**_GRPO, "clip_high": 0.28, "drop_zero_variance_groups": True},
}

SETTINGS = tuple(_GRPO)  # the keys every preset sets


def expand(algorithm: str, explicit: Mapping[str, object]) -> dict[str, object]:
    """`algorithm`'s preset with each setting `explicit` gives (not None) in its place.

    -> {setting: value} for every key of `SETTINGS`.
    """
    return {key: value if explicit.get(key) is None else explicit[key]
            for key, value in PRESETS[algorithm].items()}
