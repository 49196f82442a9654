import math

import pytest

from rollouts.sandbox.guest import codec


@pytest.mark.parametrize(
    "value",
    [None, True, 0, -(10**40), 1.5, "héllo", b"\x00\xff", [1, [2]], (1, "a"), {"k": (1, 2)}, {1, 2},
     frozenset({3}), complex(1, -2), {(1, 2): [None]}, float("inf")],
)  # fmt: skip
def test_round_trip_is_exact(value):
    out = codec.decode(codec.encode(value))
    assert out == value and type(out) is type(value)


def test_nan_round_trips():
    assert math.isnan(codec.decode(codec.encode(float("nan"))))


class AlwaysEqual:
    def __eq__(self, other):
        return True


class SneakyStr(str):
    pass


class Plain:
    pass


@pytest.mark.parametrize("value", [AlwaysEqual(), SneakyStr("x"), [1, AlwaysEqual()]])
def test_equality_tricks_are_flagged(value):
    with pytest.raises(codec.HackSuspected):
        codec.encode(value)


def test_other_objects_decode_to_opaque_values_equal_to_nothing():
    opaque = codec.decode(codec.encode(Plain()))
    assert isinstance(opaque, codec.Opaque)
    assert opaque != 1 and opaque != "x" and opaque != [] and opaque != opaque.type_name
    with pytest.raises(TypeError):
        bool(opaque)


@pytest.mark.parametrize(
    "data",
    [
        {"t": 1},
        {"x": []},
        {"t": [], "d": []},
        {"d": [[1]]},
        {"f": 3},
        {"d": [[[1], 2]]},
    ],
)
def test_malformed_input_is_rejected(data):
    with pytest.raises((ValueError, TypeError)):
        codec.decode(data)
