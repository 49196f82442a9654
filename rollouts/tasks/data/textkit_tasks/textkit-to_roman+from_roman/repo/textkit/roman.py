"""Roman numerals."""

_NUMERALS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
             (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def to_roman(n):
    """The Roman numeral of an integer 1 <= n <= 3999 (ValueError outside)."""
    raise NotImplementedError


def from_roman(s):
    """The integer value of the Roman numeral `s` (subtractive pairs such as IV count 4)."""
    raise NotImplementedError
