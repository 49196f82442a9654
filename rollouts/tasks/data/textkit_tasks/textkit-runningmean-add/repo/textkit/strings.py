"""String helpers."""

import re


def slugify(text, sep="-"):
    """Lower-case `text` and join its alphanumeric runs with `sep`.

    Runs of other characters collapse into one separator; none lead or trail.
    """
    words = re.findall(r"[a-z0-9]+", text.lower())
    return sep.join(words)


def wrap(text, width):
    """Greedily wrap the words of `text` into lines of at most `width` characters.

    A word longer than `width` gets a line of its own.
    """
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines


def is_palindrome(text):
    """True when `text` reads the same backwards, ignoring case and non-alphanumerics."""
    chars = [c.lower() for c in text if c.isalnum()]
    return chars == chars[::-1]


def count_words(text):
    """A dict from each lower-cased word of `text` to its number of occurrences."""
    counts = {}
    for word in re.findall(r"[a-z0-9']+", text.lower()):
        counts[word] = counts.get(word, 0) + 1
    return counts
