import pytest

from rollouts.tasks.documents import lookup_examples


def test_the_answer_is_the_asked_keys_value_in_exactly_one_document():
    examples = lookup_examples(50, num_documents=5, entries=3, seed=3)
    assert len(examples) == 50 and len({e.question for e in examples}) > 10
    for e in examples:
        assert len(e.documents) == 5
        lines = [line for doc in e.documents for line in doc.splitlines()]
        assert len(lines) == 15 and len({line.split("=")[0] for line in lines}) == 15
        key = e.question[:-1]
        holders = [doc for doc in e.documents if f"{key}=" in doc]
        assert len(holders) == 1
        assert f"{key}={e.answer}" in holders[0]
    assert lookup_examples(3, seed=1) == lookup_examples(3, seed=1)
    assert lookup_examples(3, seed=1) != lookup_examples(3, seed=2)


def test_bad_sizes_are_errors():
    with pytest.raises(ValueError, match="num_documents"):
        lookup_examples(1, num_documents=0)
    with pytest.raises(ValueError, match="676"):
        lookup_examples(1, num_documents=100, entries=7)
