"""Document prompts: each row's cache assembled from stored document KVs (`rollouts/kv_store.py`),
then its prompt prefilled onto them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models.documents import document_layout
from rollouts.sampler.decode import _round_up, check_tokens
from rollouts.sampler.programs import _documents_cache, _extend, _prefill, _stack_layers


class DocumentPrompts:
    """`Sampler`'s document prompts (its config, weights, buckets, `kv_store`, `_pad_prompts`,
    `run`)."""

    def _check_documents(self, documents, num_prompts: int) -> list[list[list[int]]]:
        if self.config.attention == "nsa":
            raise ValueError("documents: not supported with model.attention nsa (its blocks "
                             "assume positions that follow the cache slots)")
        if len(documents) != num_prompts:
            raise ValueError(f"documents: one list of documents per prompt, got {len(documents)} "
                             f"lists for {num_prompts} prompts")
        vocab = self.config.vocab_size
        return [[check_tokens(doc, vocab, f"documents[{i}][{j}]", "empty document")
                 for j, doc in enumerate(docs)] for i, docs in enumerate(documents)]

    def _encode_documents(self, documents: list[tuple[list[int], int]]) -> list[jax.Array]:
        """Prefill each (tokens, first position) alone, in one batch; [Y, 2, K, n, H] each."""
        tokens, segment_ids, positions = self._pad_prompts([t for t, _ in documents],
                                                           [s for _, s in documents])
        _, cache = self.run(_prefill, tokens, segment_ids, positions)
        kv = _stack_layers(cache)
        width = tokens.shape[1]
        return [kv[i, :, :, :, width - len(t):] for i, (t, _) in enumerate(documents)]

    def _prefill_documents(self, prompts: list[list[int]], documents: list[list[list[int]]]):
        """Assemble each row's cache from its documents' stored KVs (left-padded to a shared
        width, one segment: causal attention over the slots is "sees every document"), then
        prefill the prompt onto it at its final-section positions."""
        cfg = self.config
        layouts = [document_layout([len(d) for d in docs], len(p), cfg.documents)
                   for p, docs in zip(prompts, documents)]
        items = []
        for docs, (_, positions) in zip(documents, layouts):
            offsets = np.cumsum([0, *map(len, docs)])[:-1]
            items += [(d, int(positions[o])) for d, o in zip(docs, offsets)]
        tag = f"{cfg!r}#{self._weights_id}"
        entries, store_stats = self.kv_store.lookup(tag, items, self._encode_documents)

        doc_lengths = [sum(map(len, docs)) for docs in documents]
        width = _round_up(max(doc_lengths), self.prompt_bucket)
        tokens, segment_ids, positions = self._pad_prompts(
            prompts, [int(pos[-len(p)]) for p, (_, pos) in zip(prompts, layouts)])
        batch = tokens.shape[0]

        def empty(n):
            return jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads, n, cfg.head_dim), cfg.dtype)

        pieces, doc_segments = [], np.zeros((batch, width), np.int32)
        it = iter(entries)
        for r in range(batch):
            n = doc_lengths[r] if r < len(prompts) else 0
            pieces.append(empty(width - n))
            pieces += [next(it) for _ in (documents[r] if r < len(prompts) else ())]
            doc_segments[r, width - n:] = 1
        cache = _documents_cache(jnp.concatenate(pieces, axis=3), doc_segments,
                                 extra=tokens.shape[1])
        logits, cache = self.run(_extend, cache, tokens, segment_ids, positions)
        next_positions = np.array([int(pos[-1]) + 1 for _, pos in layouts])
        stats = dict(prefill_rows=batch,
                     prefill_tokens=int(segment_ids.sum()) + store_stats["tokens_encoded"],
                     kv_store=store_stats)
        return logits, cache, next_positions, stats
