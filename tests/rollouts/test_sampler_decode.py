"""The helpers `Sampler` and `Continuation` share (rollouts/sampler/decode.py): one left-pad and
one check of the sampling settings, so both name a bad argument the same way."""

import numpy as np
import pytest

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from rollouts.sampler import Continuation, Sampler
from rollouts.sampler.decode import Sampling, left_pad

CFG = ModelConfig(vocab_size=67, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8)


def test_left_pad_right_aligns_rows_and_pads_empty_ones():
    tokens, segment_ids, positions = left_pad([[5, 6, 7], [], [9]], 4, 4, starts=[0, 3, 10])
    np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0] * 4, [0, 0, 0, 9], [0] * 4])
    np.testing.assert_array_equal(segment_ids, [[0, 1, 1, 1], [0] * 4, [0, 0, 0, 1], [0] * 4])
    np.testing.assert_array_equal(positions, [[0, 0, 1, 2], [0] * 4, [0, 0, 0, 10], [0] * 4])
    assert tokens.dtype == segment_ids.dtype == positions.dtype == np.int32


def test_sampling_settings_pad_stop_ids_and_pick_the_program():
    s = Sampling.checked(67, max_new_tokens=4, temperature=0.0, top_k=None, top_p=0.9,
                         stop_token_ids=[3, 5])
    assert s.stop_ids.tolist() == [3, 5] + [-1] * 6 and s.stop_set == {3, 5}
    assert s.mode.greedy and s.mode.top_p and s.mode.top_k is None
    assert float(s.temperature) == 1.0  # greedy: unused, but a valid divisor
    assert s.finish_reason([1, 5]) == "stop" and s.finish_reason([5, 1]) == "length"
    assert s.finish_reason([]) == "length"


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens: must be >= 1"),
    (dict(temperature=-0.5), "temperature: must be >= 0"),
    (dict(top_p=0.0), r"top_p: must be in \(0, 1\]"),
    (dict(top_k=68), r"top_k: must be in \[1, vocab_size\]"),
    (dict(stop_token_ids=range(9)), "stop_token_ids: at most 8, got 9"),
])
def test_sampler_and_continuation_name_bad_settings_alike(kwargs, message):
    sampler = Sampler(init_model(CFG, seed=0))
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        sampler.generate([[1, 2]], **kwargs)
    with pytest.raises(ValueError, match=message):
        Continuation(sampler, 2, **kwargs)
