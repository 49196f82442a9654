"""Descriptive statistics over lists of numbers."""


def mean(xs):
    """The arithmetic mean; ValueError for an empty list."""
    if not xs:
        raise ValueError("mean of an empty list")
    return sum(xs) / len(xs)


def median(xs):
    """The middle value (the mean of the two middle values for an even count)."""
    if not xs:
        raise ValueError("median of an empty list")
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def variance(xs):
    """The population variance: the mean squared deviation from the mean."""
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


class RunningMean:
    """The mean of a stream of numbers, updated one value at a time."""

    def __init__(self):
        self.count = 0
        self.total = 0.0

    def add(self, x):
        """Fold `x` into the running mean; returns the new mean."""
        self.count += 1
        self.total += x
        return self.total / self.count
