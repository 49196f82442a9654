"""Hugging Face checkpoints in and out: `config.json` + `*.safetensors` (sharded or not).

HF stores a linear layer as [out, in]; we store einsum-ready [in, ...out] tensors split into
heads, so each mapping below is a transpose plus a reshape, inverted on export. MoE experts
are stored per expert (Qwen3-MoE `mlp.experts.{j}.gate_proj.weight`, Mixtral
`block_sparse_moe.experts.{j}.w1.weight`: what released checkpoints and `save_pretrained`
write) and stacked here into one [E, ...] tensor; the fused in-memory layout of
transformers >= 5 (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) is read too.

Loading onto a mesh reads each device's block straight from the files: a mapping is applied to
lazy views of the checkpoint tensors (`_View` over memory maps of the safetensors files: the same
transposes, head splits, slices and stacks, read only where asked), so every device reads the
source slices its own shard needs and no device ever holds a whole sharded tensor. Saving copies each tensor to the host shard by
shard (`jax.device_get`), never onto one device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from jaxagent.errors import UserError
from jaxagent.models.config import ModelConfig, RopeScalingConfig
from jaxagent.models.llama import Decoder
from jaxagent.models.moe import is_moe_layer
from jaxagent.models.params import logical_spec

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
_MOE_FAMILIES = ("qwen3_moe", "mixtral")
_FAMILY_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}


class CheckpointError(UserError):
    """A checkpoint directory cannot be read: the message names the file and the field."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _rope_from_hf(hf: dict, file: Path) -> tuple[float, RopeScalingConfig]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` +
    # `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(f"{file}: rope type {rope_type!r} is not supported "
                              "(supported: default, linear, llama3)")
    known = {f.name for f in dataclasses.fields(RopeScalingConfig)}
    scaling = RopeScalingConfig(rope_type=rope_type,
                                **{k: v for k, v in params.items() if k in known})
    return theta, scaling


def config_from_hf(hf: dict, file: Path = Path("config.json"), **overrides) -> ModelConfig:
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{file}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[arch]
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{file}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{file}: mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{file}: use_sliding_window=true is not supported")
    if family == "mixtral" and hf.get("sliding_window") is not None:  # Mixtral has no switch
        raise CheckpointError(f"{file}: sliding_window={hf['sliding_window']} is not supported")
    if hf.get("router_jitter_noise"):
        raise CheckpointError(f"{file}: router_jitter_noise={hf['router_jitter_noise']} is not "
                              "supported (0 only)")
    try:
        moe = _moe_from_hf(hf, family, file) if family in _MOE_FAMILIES else {}
        heads = hf["num_attention_heads"]
        theta, scaling = _rope_from_hf(hf, file)
        return ModelConfig(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            # Qwen2 always has q/k/v biases and no config key for it.
            attention_bias=hf.get("attention_bias", family == "qwen2"),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=_first(hf.get("bos_token_id")),
            eos_token_id=_first(hf.get("eos_token_id")),
            pad_token_id=_first(hf.get("pad_token_id")),
            **moe,
            **overrides,
        )
    except KeyError as e:
        raise CheckpointError(f"{file}: missing field {e.args[0]!r}") from None


def _moe_from_hf(hf: dict, family: str, file: Path) -> dict:
    # transformers >= 5 writes `num_local_experts` (an alias); released configs `num_experts`.
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise CheckpointError(f"{file}: missing field 'num_experts' (a {family} model needs "
                              "experts)")
    if family == "mixtral":  # every layer sparse, renormalised top-k, F = intermediate_size
        return {"num_experts": experts, "num_experts_per_tok": hf["num_experts_per_tok"],
                "moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True,
                "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001)}
    return {
        "num_experts": experts,
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": hf.get("norm_topk_prob", False),  # HF's default
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
    }


def _first(token_id):
    return token_id[0] if isinstance(token_id, list) else token_id


def config_to_hf(cfg: ModelConfig) -> dict:
    rope = {"rope_type": cfg.rope_scaling.rope_type}
    if cfg.rope_scaling.rope_type != "default":
        rope["factor"] = cfg.rope_scaling.factor
    if cfg.rope_scaling.rope_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_scaling.low_freq_factor,
            high_freq_factor=cfg.rope_scaling.high_freq_factor,
            original_max_position_embeddings=cfg.rope_scaling.original_max_position_embeddings,
        )
    if cfg.family == "qwen2" and not cfg.attention_bias:
        raise CheckpointError("model.attention_bias=false cannot be exported as Qwen2 (always biased)")
    if cfg.qk_norm != (cfg.family in ("qwen3", "qwen3_moe")):
        raise CheckpointError(f"model.qk_norm={cfg.qk_norm} cannot be exported as family {cfg.family!r}")
    if (cfg.num_experts > 0) != (cfg.family in _MOE_FAMILIES):
        raise CheckpointError(f"model.num_experts={cfg.num_experts} cannot be exported as family "
                              f"{cfg.family!r} (experts need {' or '.join(_MOE_FAMILIES)})")
    moe = {}
    if cfg.family == "mixtral":
        for key, value in (("norm_topk_prob", True), ("decoder_sparse_step", 1),
                           ("mlp_only_layers", ())):
            if getattr(cfg, key) != value:
                raise CheckpointError(f"model.{key}={getattr(cfg, key)!r} cannot be exported as "
                                      f"family 'mixtral' (needs {value!r})")
        moe = {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
               "intermediate_size": cfg.moe_intermediate_size,  # Mixtral's F is the experts'
               "router_aux_loss_coef": cfg.router_aux_loss_coef, "sliding_window": None}
    elif cfg.family == "qwen3_moe":
        moe = {
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers),
            "router_aux_loss_coef": cfg.router_aux_loss_coef,
        }
    return {
        "architectures": [_FAMILY_ARCH[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling.rope_type == "default" else rope,
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        # Special ids outside the vocabulary (a test model's defaults) would break HF loading.
        **{f"{name}_token_id": (i if i is not None and i < cfg.vocab_size else None)
           for name, i in (("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id),
                           ("pad", cfg.pad_token_id))},
        "torch_dtype": cfg.param_dtype,
        **moe,
    }


# ---------------------------------------------------------------------------------------------
# Tensor name and layout mapping.


Block = tuple[slice, ...]  # one slice(start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class _View:
    """An array read only where asked: a checkpoint tensor, or a transpose, head split, slice or
    stack of views. `read(block)` reads just the source slices that block needs."""

    shape: tuple[int, ...]
    read: Callable[[Block], np.ndarray]

    @property
    def T(self) -> _View:
        return self.transpose(*reversed(range(len(self.shape))))

    def transpose(self, *perm: int) -> _View:
        inverse = np.argsort(perm)  # dimension i of the result is dimension perm[i] of self
        return _View(tuple(self.shape[p] for p in perm),
                     lambda block: self.read(tuple(block[i] for i in inverse)).transpose(perm))

    def reshape(self, *shape: int) -> _View:
        """Only the reshapes the layouts use: one dimension split in several (heads)."""
        k = len(shape) - len(self.shape) + 1  # the pieces the split dimension becomes
        for a in range(len(self.shape) if k >= 1 else 0):
            if (shape[:a] == self.shape[:a] and shape[a + k:] == self.shape[a + 1:]
                    and math.prod(shape[a:a + k]) == self.shape[a]):
                break
        else:
            raise ValueError(f"shape {self.shape} does not split into {shape}")
        inner = math.prod(shape[a + 1:a + k])

        def read(block):
            # Whole rows of the inner pieces, then the block's part of them.
            outer = block[a]
            rows = self.read(block[:a] + (slice(outer.start * inner, outer.stop * inner),)
                             + block[a + k:])
            rows = rows.reshape(rows.shape[:a] + (outer.stop - outer.start, *shape[a + 1:a + k])
                                + rows.shape[a + 1:])
            return rows[(slice(None),) * (a + 1) + block[a + 1:a + k]]

        return _View(tuple(shape), read)

    def __getitem__(self, index) -> _View:
        part = _block(index if isinstance(index, tuple) else (index,), self.shape)
        return _View(tuple(s.stop - s.start for s in part), lambda block: self.read(tuple(
            slice(p.start + b.start, p.start + b.stop) for p, b in zip(part, block))))


def _block(index: tuple, shape: tuple[int, ...]) -> Block:
    """`index` (basic slices, step 1, as numpy and jax write them) as explicit start:stop."""
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"a strided index {s} of a checkpoint tensor")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def _stack(views: list[_View]) -> _View:
    """`np.stack(views)`, read lazily: a block reads only its own experts' slices."""
    if len({v.shape for v in views}) > 1:
        raise ValueError(f"stacked tensors differ in shape: {sorted({v.shape for v in views})}")
    return _View((len(views), *views[0].shape), lambda block: np.stack(
        [views[j].read(block[1:]) for j in range(block[0].start, block[0].stop)]))


@dataclasses.dataclass(frozen=True)
class _Mapping:
    hf_names: tuple[str, ...]  # one tensor, or one per expert
    path: tuple  # our nnx parameter path
    to_ours: Callable[[list[_View]], _View]  # on lazy views of the checkpoint's tensors
    to_hf: Callable[[np.ndarray], list[np.ndarray]] | None  # None: read-only layout


def _same(x):
    return x


# Per-expert checkpoint names of (gate, up, down) and the sparse block's module name.
_EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def _expert_map(layer: str, path: tuple, cfg: ModelConfig, fused: bool) -> list[_Mapping]:
    """A sparse layer's router and experts: HF [E, D] router, [F, D] / [D, F] per expert."""
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    block, *names = _EXPERT_NAMES[cfg.family]
    # transformers >= 5 names the block `mlp` in memory (fused) for every family.
    pre = f"{layer}{'mlp' if fused else block}."
    out = [_Mapping((pre + "gate.weight",), path + ("router",), lambda ws: ws[0].T,
                    lambda w: [w.T])]
    if fused:  # [E, 2F, D] gate|up and [E, D, F] down; written by no exporter, so read-only
        swap = lambda w: w.transpose(0, 2, 1)
        return out + [
            _Mapping((pre + "experts.gate_up_proj",), path + ("w_gate",),
                     lambda ws: swap(ws[0][:, :f]), None),
            _Mapping((pre + "experts.gate_up_proj",), path + ("w_up",),
                     lambda ws: swap(ws[0][:, f:]), None),
            _Mapping((pre + "experts.down_proj",), path + ("w_down",),
                     lambda ws: swap(ws[0]), None),
        ]
    return out + [
        _Mapping(tuple(f"{pre}experts.{j}.{name}.weight" for j in range(e)), path + (ours,),
                 lambda ws: _stack([w.T for w in ws]), lambda w: [x.T for x in w])
        for name, ours in zip(names, ("w_gate", "w_up", "w_down"))
    ]


def _tensor_map(cfg: ModelConfig, fused_experts: bool = False) -> list[_Mapping]:
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def heads_in(num):  # [num*h, d] -> [d, num, h]
        return lambda w: w.T.reshape(d, num, h), lambda w: w.reshape(d, num * h).T

    def bias(num):  # [num*h] -> [num, h]
        return lambda b: b.reshape(num, h), lambda b: b.reshape(num * h)

    transpose = (lambda w: w.T, lambda w: w.T)
    same = (_same, _same)
    o_proj = (lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(n * h, d).T)

    def m(hf_name, path, like):  # one HF tensor <-> one parameter
        to_ours, to_hf = like
        return _Mapping((hf_name,), path, lambda ws: to_ours(ws[0]), lambda w: [to_hf(w)])

    out = [m("model.embed_tokens.weight", ("embed",), same),
           m("model.norm.weight", ("final_norm", "scale"), same)]
    if not cfg.tie_embeddings:
        out.append(m("lm_head.weight", ("lm_head",), transpose))
    for i in range(cfg.num_layers):
        pre, at = f"model.layers.{i}.", ("layers", i, "attn")
        out += [
            m(pre + "input_layernorm.weight", ("layers", i, "attn_norm", "scale"), same),
            m(pre + "post_attention_layernorm.weight", ("layers", i, "mlp_norm", "scale"), same),
            m(pre + "self_attn.q_proj.weight", at + ("wq",), heads_in(n)),
            m(pre + "self_attn.k_proj.weight", at + ("wk",), heads_in(k)),
            m(pre + "self_attn.v_proj.weight", at + ("wv",), heads_in(k)),
            m(pre + "self_attn.o_proj.weight", at + ("wo",), o_proj),
        ]
        if is_moe_layer(cfg, i):
            out += _expert_map(pre, ("layers", i, "mlp"), cfg, fused_experts)
        else:
            out += [m(pre + f"mlp.{x}_proj.weight", ("layers", i, "mlp", f"w_{x}"), transpose)
                    for x in ("gate", "up", "down")]
        if cfg.attention_bias:
            out += [m(pre + f"self_attn.{x}_proj.bias", at + (f"b{x}",), bias(num))
                    for x, num in (("q", n), ("k", k), ("v", k))]
            if cfg.out_bias:
                out.append(m(pre + "self_attn.o_proj.bias", at + ("bo",), same))
        if cfg.qk_norm:
            out += [m(pre + f"self_attn.{x}_norm.weight", at + (f"{x}_norm", "scale"), same)
                    for x in ("q", "k")]
    return out


# ---------------------------------------------------------------------------------------------
# Loading and saving.


def _tensor_files(path: Path) -> dict[str, Path]:
    """{tensor name: file} from the sharded index, or from every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return {name: file for file in files for name in _mapped_tensors(file)}


# safetensors dtypes -> numpy's (ml_dtypes' bfloat16, which safetensors' numpy reader lacks)
_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32,
           "I64": np.int64, "F16": np.float16, "F32": np.float32, "F64": np.float64,
           "BF16": jnp.bfloat16}


def _mapped_tensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only memory map: indexing one reads just
    that block from the file. (The format: an 8-byte little-endian header size, a JSON header
    of {name: dtype, shape, data_offsets}, then the data.)"""
    try:
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        data = np.memmap(file, np.uint8, mode="r", offset=8 + size)
        entries = {name: (t["dtype"], t["shape"], t["data_offsets"])
                   for name, t in header.items() if name != "__metadata__"}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            ValueError) as e:
        raise CheckpointError(f"{file}: not a safetensors file ({type(e).__name__}: {e})") from None
    out = {}
    for name, (dtype, shape, (begin, end)) in entries.items():
        if dtype not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype}, not supported "
                                  f"({', '.join(_DTYPES)})")
        if end - begin != math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize:
            raise CheckpointError(f"{file}: tensor {name!r}: data_offsets [{begin}, {end}) do "
                                  f"not hold {dtype} of shape {shape}")
        out[name] = data[begin:end].view(_DTYPES[dtype]).reshape(shape)
    return out


# "org/name" or "org/name@revision": a Hugging Face hub id (a path that exists wins)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# what a model needs from a hub repository: config, weights, tokenizer and generation files
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def resolve_checkpoint(spec: str | Path) -> Path:
    """A local checkpoint directory for `spec`: a path, or a hub id resolved through the
    Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`; with `HF_HUB_OFFLINE=1` the cache alone)."""
    path = Path(spec)
    if path.exists() or not _HUB_ID.match(str(spec)):
        return path
    from huggingface_hub import snapshot_download

    repo_id, _, revision = str(spec).partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None,
                                      allow_patterns=_HUB_FILES))
    except Exception as e:  # not on the hub, not cached while offline, no network
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        raise CheckpointError(f"{spec}: no such directory, and the Hugging Face hub gave no "
                              f"model ({type(e).__name__}: {first[:160]})") from None


def read_json(file: Path, kind: str) -> dict:
    """The contents of a JSON file of a directory of `kind` ("an HF checkpoint directory")."""
    if not file.exists():
        raise CheckpointError(f"{file}: not found (is {file.parent} {kind}?)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from None


def read_config(path: str | Path) -> ModelConfig:
    file = Path(path) / "config.json"
    return config_from_hf(read_json(file, "an HF checkpoint directory"), file)


def from_pretrained(path: str | Path, dtype: str = "bfloat16", compute_dtype: str | None = None,
                    *, mesh: Mesh | None = None, rules=None, **config_overrides) -> Decoder:
    """Load an HF Llama/Qwen2/Qwen3/Qwen3-MoE checkpoint directory as a `Decoder`.

    `dtype` is the parameter dtype; activations use `compute_dtype` (default: the same). With
    `mesh` and `rules` (config `mesh.rules`) every parameter is made on the mesh, laid out by
    its logical axes as `sharding.rules.place` would: each device reads only its own block.
    Without, each is put whole on the default device.
    """
    if (mesh is None) != (rules is None):
        raise ValueError("from_pretrained: give mesh and rules together (or neither)")
    path = Path(path)
    cfg = dataclasses.replace(read_config(path), param_dtype=dtype,
                              dtype=compute_dtype or dtype, **config_overrides)
    files = _tensor_files(path)
    fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in files)
    # Build the module without materialising random weights, then fill every parameter.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(state))
    mapped: dict[Path, dict[str, np.ndarray]] = {}
    mappings = _tensor_map(cfg, fused_experts=fused)
    for mapping in mappings:
        views = []
        for name in mapping.hf_names:
            file = files.get(name)
            if file is None:
                raise CheckpointError(f"{path}: missing tensor {name!r}")
            if file not in mapped:
                mapped[file] = _mapped_tensors(file)
            if name not in mapped[file]:
                raise CheckpointError(f"{file}: missing tensor {name!r} (the index names it)")
            tensor = mapped[file][name]
            views.append(_View(tuple(tensor.shape), lambda block, t=tensor: np.array(t[block])))
        var = flat[mapping.path]
        try:
            value = mapping.to_ours(views)
            fits = value.shape == var.shape
        except ValueError:  # a split or stack the checkpoint's shapes do not allow
            fits = False
        if not fits:
            got = ", ".join(str(v.shape) for v in views[:2]) + (", ..." if len(views) > 2 else "")
            raise CheckpointError(
                f"{file}: tensor {mapping.hf_names[-1]!r} has shape {got}, which does not "
                f"convert to the shape {var.shape} config.json gives"
            )
        sharding = None
        if mesh is not None:
            names = var.get_metadata().get("logical_axes")  # none: replicated
            sharding = NamedSharding(mesh, PartitionSpec() if names is None
                                     else logical_spec(var.shape, names, rules, mesh))
        var.set_value(_materialise(value, sharding, jnp.dtype(dtype)))
    used = {name for mapping in mappings for name in mapping.hf_names}
    unused = sorted(name for name in files if name not in used and not _ignorable(name, cfg))
    if unused:
        raise CheckpointError(f"{path}: {len(unused)} tensor(s) this {cfg.family} model has no "
                              f"place for (loading would change the model): {', '.join(unused[:4])}"
                              + (", ..." if len(unused) > 4 else ""))
    return nnx.merge(graphdef, state)


def _ignorable(name: str, cfg) -> bool:
    """Tensors a checkpoint may carry that define nothing: RoPE's cached frequencies (older
    Llama files), the LM head of a tied model (a copy of the embedding)."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_embeddings)


def _materialise(view: _View, sharding: NamedSharding | None, dtype) -> jax.Array:
    """`view` as an array of `dtype`: whole on the default device (`sharding` None), or each
    addressable device's block read on its own (devices with the same block share one read)."""
    if sharding is None:
        return jnp.asarray(view.read(_block((), view.shape)), dtype)
    reads: dict[tuple, np.ndarray] = {}

    def block(index) -> np.ndarray:
        part = _block(index, view.shape)
        key = tuple((s.start, s.stop) for s in part)
        if key not in reads:
            reads[key] = np.asarray(view.read(part), dtype)
        return reads[key]

    return jax.make_array_from_callback(view.shape, sharding, block)


def save_pretrained(model: Decoder, path: str | Path, max_shard_bytes: int = 2**31) -> Path:
    """Write `config.json` + safetensors (sharded with an index past `max_shard_bytes`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for m in _tensor_map(cfg):
        # device_get copies shard by shard into host memory: no device gathers the tensor.
        values = m.to_hf(np.asarray(jax.device_get(flat[m.path].get_value())))
        tensors.update({name: np.ascontiguousarray(v) for name, v in zip(m.hf_names, values)})
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path
