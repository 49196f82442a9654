import pytest
from textkit.stats import RunningMean, mean, median, variance


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5
    with pytest.raises(ValueError):
        mean([])


def test_median_odd_and_even():
    assert median([5, 1, 3]) == 3
    assert median([4, 1, 3, 2]) == 2.5


def test_variance():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9]) == 4.0


def test_running_mean():
    r = RunningMean()
    assert [r.add(x) for x in (2, 4, 9)] == [2.0, 3.0, 5.0]
