from textkit.strings import count_words, is_palindrome, slugify, wrap


def test_slugify_joins_words():
    assert slugify("Hello, World!") == "hello-world"


def test_slugify_collapses_separators_and_custom_sep():
    assert slugify("  a -- b__c  ", sep="_") == "a_b_c"


def test_wrap_greedy():
    assert wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]


def test_wrap_long_word_alone():
    assert wrap("a supercalifragilistic b", 5) == ["a", "supercalifragilistic", "b"]


def test_is_palindrome():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("jaxagent")


def test_count_words():
    assert count_words("the cat and The hat") == {"the": 2, "cat": 1, "and": 1, "hat": 1}
