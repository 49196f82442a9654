"""The `model` config section: the decoder's architecture and how to run it (attention kind,
dtypes, remat, MoE dispatch). The models read it; jaxagent.config composes it into `Config`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class RopeScalingConfig:
    # "default" (none), "linear" or "llama3" (Llama 3.1 frequency-dependent scaling).
    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class NSAConfig:
    """Native Sparse Attention (arXiv 2502.11089) hyper-parameters; defaults are the paper's."""

    compress_block: int = 32  # l: keys summarised by one compressed key
    compress_stride: int = 16  # d: stride between compressed blocks
    select_block: int = 64  # l': keys per selection block
    num_selected: int = 16  # n: selected blocks per query (incl. block 0 and the local ones)
    num_local_blocks: int = 2  # selection blocks ending at the query, always selected
    window: int = 512  # w: sliding-window length
    # Branches run as Pallas kernels (training and prefill; decoding stays XLA): "auto" is, on a
    # Hopper GPU, the fastest per branch as timed on an H200 (selected and compressed kernels,
    # cuDNN's sliding window), the selected branch on other GPUs and TPU, and none on CPU;
    # "select"; "all" adds the window and the compressed branch with block scoring; "xla" none.
    # On CPU kernels run interpreted (slow: for checks).
    kernels: Literal["auto", "xla", "select", "all"] = "auto"
    # GPU kernels of the three branches: Mosaic GPU on Hopper (TMA + wgmma; bf16, head dims of
    # 64/128, selection blocks of 64, l'/d <= 4; other inputs fall back to Triton) under "auto"
    # and "mosaic", Pallas Triton before Hopper and under "triton".
    gpu_kernels: Literal["auto", "triton", "mosaic"] = "auto"


@dataclass(frozen=True)
class DocumentConfig:
    """Document-level attention (`model.attention: doc`): a prompt is documents, each attending
    only within itself, then a final section attending to all of them and to itself."""

    # Each document's RoPE positions start at 0, so its KV is the same wherever it lands in a
    # prompt (cacheable, `rollouts/kv_store.py`). False: positions run on across documents.
    restart_positions: bool = True
    # Where the final section's positions start when documents restart: "sum" (after all the
    # documents' tokens: query-to-document distances grow with the number of documents, as in
    # a plain concatenation) or "longest" (after the longest document: positions stay within
    # one document's range however many are attached, but all documents look equally near).
    final_positions: Literal["sum", "longest"] = "sum"


# What `LoraConfig.targets` can name: HF module names (peft's `target_modules`).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "embed_tokens", "lm_head")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, arXiv 2106.09685): each targeted weight W runs as
    W + scale * A B with A [in, r], B [r, out]; only A and B train, W stays frozen."""

    rank: int = 0  # r; 0 = no adapters (every weight trains)
    alpha: float = 16.0  # scale = alpha / r
    rslora: bool = False  # rank-stabilised scale alpha / sqrt(r) (peft `use_rslora`)
    # Dropout on each adapter's input (peft `lora_dropout`), in the training steps' loss pass
    # only: the sampler, eval, the proximal log-probs and the KL reference run without it.
    dropout: float = 0.0
    # fnmatch patterns over LORA_TARGETS ("*_proj": every projection). In sparse MoE layers
    # gate/up/down_proj adapt every expert (gate and up together, as one fused adapter of
    # rank 2r: targeting one without the other is a config error there); the router takes none.
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj")
    # How the sampler runs the adapters: merged into its copy of the weights at each publish
    # (decode at base speed), or unmerged beside them (x A B per projection per step).
    sampler: Literal["merged", "unmerged"] = "merged"
    # Modules trained whole beside the adapters (peft `modules_to_save`): embed_tokens (a tied
    # model's head too), and lm_head when the embedding is untied.
    modules_to_save: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """A Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral decoder. Defaults: the tiny byte-level
    model for CPU runs."""

    # HF architecture written on export.
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"] = "qwen3"
    vocab_size: int = 264  # 256 bytes + specials, padded to a multiple of 8
    # A model at random init reads bytes, or a byte-level BPE of at most vocab_size ids learnt
    # at the run's start from its own texts (`jaxagent.train.sft.fit_tokenizer`; ~3 bytes a
    # token on the embedded agent family) and kept in workdir/tokenizer. A checkpoint
    # (init_from) brings its own tokenizer.
    tokenizer: Literal["bytes", "bpe"] = "bytes"
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = True  # RMSNorm on q and k per head (Qwen3)
    tie_embeddings: bool = True
    max_position_embeddings: int = 4096
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype of activations
    # What a training pass keeps of each layer for the backward pass: everything (none),
    # only the matmuls with the weights (dots: recompute norms, RoPE, attention, SwiGLU) or
    # only the layer's input (full: recompute the whole layer).
    remat: Literal["none", "dots", "full"] = "none"
    # dense; nsa: Native Sparse Attention, see `nsa`; doc: document-level prompts laid out by
    # `documents` (pallas_kernels.attention: one function per kind).
    attention: Literal["dense", "nsa", "doc"] = "dense"
    # How dense and doc attention run: auto (per platform and row layout), xla, pallas (the
    # block-sparse doc kernel; interpreted on CPU), cudnn (GPU, bfloat16, causal rows) or
    # splash (TPU; interpreted on CPU; causal rows). pallas_kernels/attention.py and
    # docs/attention.md say what auto picks and where each runs. NSA's kernels are `nsa.kernels`.
    attention_backend: Literal["auto", "xla", "pallas", "cudnn", "splash"] = "auto"
    documents: DocumentConfig = field(default_factory=DocumentConfig)  # when attention is "doc"
    nsa: NSAConfig = field(default_factory=NSAConfig)  # used when attention is "nsa"
    bos_token_id: int | None = 256
    eos_token_id: int | None = 257
    pad_token_id: int | None = 258
    # Sparse mixture-of-experts MLP (Qwen3-MoE semantics); num_experts = 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 2  # top-k experts per token
    moe_intermediate_size: int = 128  # F of each expert
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse if (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (dense MLP)
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in SFT / RL losses
    # dropless: every token reaches its k experts (ragged_dot grouped matmul; exact, HF parity;
    # native on TPU, expanded densely by XLA on CPU/GPU: see docs/benchmarks.md).
    # capacity: each expert takes at most ceil(capacity_factor * tokens * k / E) assignments,
    # first choices before second ones; the rest are dropped (static shapes, expert-parallel).
    # dense: every expert on every token, zero-weighted off the top-k (E/K x FLOPs; reference).
    moe_dispatch: Literal["dropless", "capacity", "dense"] = "dropless"
    capacity_factor: float = 1.25
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters; rank 0 = none

    @property
    def out_bias(self) -> bool:
        """attention_bias biases the output projection too in Llama and Qwen3, not in Qwen2."""
        return self.attention_bias and self.family != "qwen2"

    def __post_init__(self):
        if self.attention == "nsa" and self.attention_backend != "auto":
            raise ValueError("attention_backend: NSA's kernels are picked by model.nsa.kernels "
                             "(auto, xla, select, all); leave attention_backend at auto")
