"""jaxagent.rl.algorithms: each `rl.algorithm` expands to its paper's settings; explicit wins."""

import dataclasses
import typing

import pytest

from jaxagent.rl.algorithms import PRESETS, SETTINGS, expand
from jaxagent.rl.config import RLConfig

# Written out by hand (not derived from the table): what each algorithm means.
EXPECTED = {
    "grpo": dict(baseline="mean", normalize_std=True, clip_low=0.2, clip_high=0.2,
                 aggregation="token-mean", drop_zero_variance_groups=False),
    "dr_grpo": dict(baseline="mean", normalize_std=False, clip_low=0.2, clip_high=0.2,
                    aggregation="seq-mean-token-sum-norm", drop_zero_variance_groups=False),
    "rloo": dict(baseline="leave_one_out", normalize_std=False, clip_low=0.2, clip_high=0.2,
                 aggregation="token-mean", drop_zero_variance_groups=False),
    "dapo": dict(baseline="mean", normalize_std=True, clip_low=0.2, clip_high=0.28,
                 aggregation="token-mean", drop_zero_variance_groups=True),
}


@pytest.mark.parametrize("algorithm", sorted(EXPECTED))
def test_each_algorithm_expands_to_its_settings(algorithm):
    assert expand(algorithm, {}) == EXPECTED[algorithm]
    assert expand(algorithm, dict.fromkeys(SETTINGS)) == EXPECTED[algorithm]  # None: unset


def test_the_table_covers_the_config():
    """Every `rl.algorithm` choice has a preset, and every setting is an `rl` key whose
    default is None (unset, so the preset fills it)."""
    hints = typing.get_type_hints(RLConfig)
    assert set(typing.get_args(hints["algorithm"])) == set(PRESETS) == set(EXPECTED)
    defaults = {f.name: f.default for f in dataclasses.fields(RLConfig)}
    assert all(defaults[key] is None for key in SETTINGS)
    assert all(preset.keys() == set(SETTINGS) for preset in PRESETS.values())


@pytest.mark.parametrize("algorithm", sorted(EXPECTED))
def test_an_explicit_setting_wins_over_the_preset(algorithm):
    explicit = {"clip_high": 0.25, "aggregation": "seq-mean-token-mean", "normalize_std": False,
                "drop_zero_variance_groups": False}
    got = expand(algorithm, explicit)
    assert got == {**EXPECTED[algorithm], **explicit}
    # False and 0.0 are explicit values, not "unset".
    assert expand(algorithm, {"drop_zero_variance_groups": False})["drop_zero_variance_groups"] is False
