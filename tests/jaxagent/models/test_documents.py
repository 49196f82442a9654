import numpy as np
import pytest

from jaxagent.models.config import DocumentConfig
from jaxagent.models.documents import document_layout, final_start


@pytest.mark.parametrize(("cfg", "final_positions"), [
    (DocumentConfig(), [12, 13, 14]),
    (DocumentConfig(final_positions="longest"), [5, 6, 7]),
    (DocumentConfig(restart_positions=False), [12, 13, 14]),
])
def test_layout_segments_and_positions(cfg, final_positions):
    segments, positions = document_layout([5, 3, 4], 3, cfg)
    np.testing.assert_array_equal(segments, [1] * 5 + [2] * 3 + [3] * 4 + [-1] * 3)
    docs = positions[:12]
    want = (np.r_[np.arange(5), np.arange(3), np.arange(4)] if cfg.restart_positions
            else np.arange(12))
    np.testing.assert_array_equal(docs, want)
    np.testing.assert_array_equal(positions[12:], final_positions)
    assert final_start([5, 3, 4], cfg) == final_positions[0]


def test_no_documents_and_empty_final_section():
    segments, positions = document_layout([], 4)
    np.testing.assert_array_equal(segments, [-1] * 4)
    np.testing.assert_array_equal(positions, np.arange(4))
    segments, _ = document_layout([2], 0)
    np.testing.assert_array_equal(segments, [1, 1])


def test_bad_lengths_are_errors():
    with pytest.raises(ValueError, match="must not be empty"):
        document_layout([3, 0], 2)
    with pytest.raises(ValueError, match="final_length"):
        document_layout([3], -1)
