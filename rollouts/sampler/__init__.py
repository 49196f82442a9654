"""JAX-native sampler: jitted prefill and decode over a preallocated, growing KV cache.

Letters (all modules): B batch rows, P prompts, G samples per prompt, L prompt length, S cache
slots, N generated-token buffer, V vocab; for document KVs (`rollouts/kv_store.py`) also Y layers,
K kv heads, H head dim, W document slots per row.

How a call runs:
1. Prompts are left-padded to a bucketed length L (segment id 0 marks padding), so every row
   writes its next token to the same cache slot and one `dynamic_update_slice` serves all.
2. Group prefix sharing: each distinct prompt is prefilled once; its cache rows and last
   logits are repeated to its G decoding rows ("prefill once, many decoders").
3. Decoding runs in jitted segments of `segment_steps` tokens (a `lax.while_loop` that also
   stops when every row is done). Between segments the host grows the cache by
   `cache_bucket` slots only when needed, so attention cost follows the tokens actually
   in the cache, not a worst-case capacity, and compacts the batch to half its size once
   half the rows have finished, so finished rows stop costing compute.
4. On a CPU backend a call's prompts are split over host threads (`host_threads`, default
   the cores), each running steps 1-3 on its rows: XLA:CPU runs a small decode step's ops
   on one core. Row ids stay global, so outputs equal one thread's. Multi-turn episodes
   (`continuation(...)`) split their slots the same way (`ThreadedContinuation`).
All shapes are bucketed (batch, prompt length, cache size, output buffer), so repeated calls
reuse compiled programs.

Modules: `config` (`SamplerConfig`, the `sampler` config section), `sampling` (the math of one
token), `programs` (the jitted programs), `decode` (checked inputs and settings, the decode
state and its segment loop, shared by `Sampler` and `Continuation`), `sampler` (`Sampler`),
`documents` (document prompts from stored KVs), `continuation` (`Continuation`), `threads`
(host threads: split calls, `ThreadedContinuation`).
"""

from rollouts.sampler.config import SamplerConfig
from rollouts.sampler.continuation import Continuation
from rollouts.sampler.decode import SampleOutput

# tests read the programs' compile caches and the math's private helpers through the package
from rollouts.sampler.programs import _decode_segment, _prefill  # noqa: F401
from rollouts.sampler.sampler import Sampler
from rollouts.sampler.sampling import (  # noqa: F401
    _argmax,
    _log_softmax_at,
    _SamplingMode,
    sample_tokens,
    sampling_logits,
)
from rollouts.sampler.threads import ThreadedContinuation, continuation

__all__ = [
    "Continuation",
    "SampleOutput",
    "Sampler",
    "SamplerConfig",
    "ThreadedContinuation",
    "continuation",
    "sample_tokens",
    "sampling_logits",
]
