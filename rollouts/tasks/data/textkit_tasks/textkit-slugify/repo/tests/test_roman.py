import pytest
from textkit.roman import from_roman, to_roman


def test_to_roman():
    assert [to_roman(n) for n in (1, 4, 9, 14, 40, 1994, 3999)] == [
        "I", "IV", "IX", "XIV", "XL", "MCMXCIV", "MMMCMXCIX"]
    with pytest.raises(ValueError):
        to_roman(0)


def test_from_roman():
    assert [from_roman(s) for s in ("III", "IV", "XLII", "MCMXCIV")] == [3, 4, 42, 1994]


def test_round_trip():
    assert all(from_roman(to_roman(n)) == n for n in range(1, 400))
