"""Adapters on a whole decoder: fresh, attached, merged away, and as PEFT directories
(`adapter_config.json` + `adapter_model.safetensors`, the layout `peft` writes and reads).

peft stores a factor pair per module as `lora_A.weight` [r, in] and `lora_B.weight` [out, r]
(an embedding: `lora_embedding_A` [r, V], `lora_embedding_B` [D, r]), its `in`/`out` the HF
weight's flattened axes; ours are A [in..., r] and B [r, out...], so each is a reshape and a
transpose (lora.py).

MoE experts (peft with transformers >= 5, whose experts are fused 3-D parameters
`mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F]): peft targets them
with `target_parameters` and wraps the experts module once per parameter, gate_up_proj inside
(`experts.base_layer.lora_*` when down_proj is wrapped too) and down_proj outside
(`experts.lora_*`). Its factors are `lora_A.weight` [E r', in] (row e r' + j) and
`lora_B.weight` [out, r' E] (column j E + e); the fused adapter has rank and alpha patterns
r' = 2r, 2 alpha.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxagent.models.config import LORA_TARGETS, LoraConfig, ModelConfig
from jaxagent.models.hf import CheckpointError, read_json, save_pretrained
from jaxagent.models.llama import Decoder
from jaxagent.models.lora import (
    EXPERT_WEIGHTS,
    WEIGHT_OF,
    ExpertLoraParam,
    LoraParam,
    SavedParam,
    lora_targets,
    merge,
)

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _abstract(cfg: ModelConfig) -> Decoder:
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))


def init_adapters(cfg: ModelConfig, seed: int) -> nnx.State:
    """Fresh adapter factors for a decoder of `cfg` (one program: the base weights it would
    draw are dead code, never computed); `with_adapters` adds the modules to save."""
    fresh = nnx.All(LoraParam, nnx.Not(SavedParam))
    init = nnx.jit(lambda key: nnx.state(Decoder(cfg, rngs=nnx.Rngs(params=key)), fresh))
    return init(jax.random.key(seed))


def split_adapters(model: Decoder) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, adapter factors, every other weight: the frozen base)."""
    return nnx.split(model, LoraParam, ...)


def split_trainable(weights: nnx.State) -> tuple[nnx.State, nnx.State | None]:
    """(what trains, what stays frozen) of a decoder's weights: with adapters, their factors
    and the base; without, every weight and None."""
    factors, base = nnx.split_state(weights, LoraParam, ...)
    return (factors, base) if factors else (weights, None)


def with_adapters(model: Decoder, lora: LoraConfig, factors: nnx.State) -> Decoder:
    """`model`'s base weights (not copied) under adapters `factors` of config `lora`; a module
    to save that `factors` lacks starts from the base's weight."""
    cfg = dataclasses.replace(model.config, lora=lora)
    _, own, base = split_adapters(model)
    base, factors = dict(nnx.to_flat_state(base)), dict(nnx.to_flat_state(factors))
    for name in lora.modules_to_save:
        path = (WEIGHT_OF[name],)
        w = base.pop(path) if path in base else dict(nnx.to_flat_state(own))[path]
        if path not in factors:
            factors[path] = SavedParam(w[...], **w.get_metadata())
    return nnx.merge(nnx.graphdef(_abstract(cfg)), nnx.from_flat_state(base),
                     nnx.from_flat_state(factors))


def base_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """The graph of a decoder of `cfg` without adapters."""
    return nnx.graphdef(_abstract(dataclasses.replace(cfg, lora=LoraConfig())))


def _plain(model: Decoder, weights: nnx.State) -> Decoder:
    return nnx.merge(base_graphdef(model.config), weights)


def without_adapters(model: Decoder) -> Decoder:
    """`model`'s base: the same weights (not copied), no adapters. A module trained whole
    (`modules_to_save`) keeps its trained weight, as no copy of the base's is kept: a PEFT
    directory over this base gives the same model (its saved copy replaces the base's)."""
    _, factors, base = split_adapters(model)
    # `merge` with the saved modules alone: they replace the base's, no adapter adds to it
    return _plain(model, merge(base, factors.filter(SavedParam), model.config.lora))


def merged(model: Decoder) -> Decoder:
    """A decoder without adapters whose weights are `model`'s with its adapters merged in
    (`model` itself if it has none)."""
    if not model.config.lora.rank:
        return model
    _, factors, base = split_adapters(model)
    return _plain(model, merge(base, factors, model.config.lora))


# ---------------------------------------------------------------------------------------------
# PEFT directories.


def _hf_module(path: tuple) -> str:
    """Our factor path -> the HF module it adapts: ("layers", 3, "attn", "lora", "q_proj", "a")
    -> "model.layers.3.self_attn.q_proj"."""
    *owner, _, name, _ = path
    if not owner:
        return "lm_head" if name == "lm_head" else f"model.{name}"
    _, layer, block = owner
    return f"model.layers.{layer}.{'self_attn' if block == 'attn' else 'mlp'}.{name}"


# peft's rank and alpha patterns for the experts' fused gate-up adapter
_FUSED = r".*\.gate_up_proj"


def _hf_key(path: tuple, var: nnx.Variable, lora: LoraConfig) -> str:
    factor = "A" if path[-1] == "a" else "B"
    if path[-2] == "embed_tokens":
        return f"{_PREFIX}{_hf_module(path)}.lora_embedding_{factor}"
    if isinstance(var, ExpertLoraParam):
        inner = path[-2] == "gate_up_proj" and "down_proj" in lora_targets(lora)
        experts = f"model.layers.{path[1]}.mlp.experts{'.base_layer' if inner else ''}"
        return f"{_PREFIX}{experts}.lora_{factor}.weight"
    return f"{_PREFIX}{_hf_module(path)}.lora_{factor}.weight"


def _saved_key(name: str) -> str:
    """peft's key of a module saved whole (HF layout: the table and the head both [V, D])."""
    return f"{_PREFIX}{_hf_module(('lora', name, 'a'))}.weight"


def _to_peft(path: tuple, x: np.ndarray, expert: bool) -> np.ndarray:
    """Our factor -> peft's: A [in..., r] -> [r, in], B [r, out...] -> [out, r]; an expert's
    A [E, in, r'] -> [E r', in], B [E, r', P, out] -> [P out, r' E]."""
    if expert and path[-1] == "a":
        return x.transpose(0, 2, 1).reshape(-1, x.shape[1])
    if expert:
        return x.reshape(*x.shape[:2], -1).transpose(2, 1, 0).reshape(-1, x.shape[0] * x.shape[1])
    return x.reshape(-1, x.shape[-1]).T if path[-1] == "a" else x.reshape(x.shape[0], -1).T


def _from_peft(path: tuple, x: np.ndarray, shape: tuple, expert: bool) -> np.ndarray:
    """The inverse of `_to_peft` for a factor of our `shape`."""
    if expert and path[-1] == "a":
        e, i, r = shape
        return x.reshape(e, r, i).transpose(0, 2, 1)
    if expert:
        e, r, p, o = shape
        return x.reshape(p * o, r, e).transpose(2, 1, 0).reshape(shape)
    return x.T.reshape(shape)


def save_adapter(model: Decoder, path: str | Path, base_model: str | None = None) -> Path:
    """Write `model`'s adapters as a PEFT directory (`base_model`: the base checkpoint's path
    or hub id, written as `base_model_name_or_path`)."""
    lora = model.config.lora
    if not lora.rank:
        raise CheckpointError(f"{path}: the model has no adapters (model.lora.rank is 0)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _, factors, _ = split_adapters(model)
    tensors, modules, parameters = {}, set(), set()
    for p, var in nnx.to_flat_state(factors):
        if isinstance(var, SavedParam):
            continue
        expert = isinstance(var, ExpertLoraParam)
        x = np.asarray(jax.device_get(var[...]), np.float32)
        tensors[_hf_key(p, var, lora)] = np.ascontiguousarray(_to_peft(p, x, expert))
        (parameters if expert else modules).add(p[-2])
    tied = model.config.tie_embeddings
    for name in lora.modules_to_save:
        w = np.asarray(jax.device_get(getattr(model, WEIGHT_OF[name])[...]), np.float32)
        tensors[_saved_key(name)] = np.ascontiguousarray(w.T if name == "lm_head" else w)
    if tied and lora.modules_to_save:  # peft ties the head's copy to the table's, and saves both
        tensors[_saved_key("lm_head")] = tensors[_saved_key("embed_tokens")]
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    fused = "gate_up_proj" in parameters
    (path / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "use_rslora": lora.rslora,
        "target_modules": sorted(modules), "target_parameters": sorted(parameters) or None,
        "rank_pattern": {_FUSED: 2 * lora.rank} if fused else {},
        "alpha_pattern": {_FUSED: 2 * lora.alpha} if fused else {},
        "lora_dropout": lora.dropout, "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": list(lora.modules_to_save) or None,
        "ensure_weight_tying": tied and bool(lora.modules_to_save), "inference_mode": True,
    }, indent=2))
    return path


def save_policy(model: Decoder, path: str | Path, base_model: str | None = None) -> Path:
    """A trained decoder as files other programs load: an HF checkpoint, or with adapters a
    PEFT directory over `base_model` (None: a random base, written beside into `path/base`)."""
    if not model.config.lora.rank:
        return save_pretrained(model, path)
    if base_model is None:
        base_model = str(save_pretrained(without_adapters(model), Path(path) / "base").absolute())
    return save_adapter(model, path, base_model)


# adapter_config.json settings we do not implement, with the value that means "off"
_UNSUPPORTED = {"bias": "none", "use_dora": False, "fan_in_fan_out": False,
                "layers_to_transform": None}


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def read_adapter_config(path: str | Path) -> tuple[LoraConfig, str | None]:
    """(the adapters' LoraConfig, the base checkpoint it names or None) of a PEFT directory."""
    file = Path(path) / CONFIG_FILE
    hf = read_json(file, "a PEFT adapter directory")
    if hf.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: peft_type {hf.get('peft_type')!r} is not supported (LORA)")
    for key, off in _UNSUPPORTED.items():
        if hf.get(key, off) not in (off, None, [], {}):
            raise CheckpointError(f"{file}: {key}={hf[key]!r} is not supported")
    targets = hf.get("target_modules") or []
    if targets == "all-linear":
        targets = LoraConfig.targets  # every projection, the head not
    if isinstance(targets, str) or set(targets) - set(LORA_TARGETS):
        raise CheckpointError(f"{file}: target_modules {targets!r} is not supported (a list of "
                              f"{', '.join(LORA_TARGETS)}, or all-linear)")
    # the experts' fused parameters, by their last name ("mlp.experts.down_proj" -> down_proj)
    parameters = {t.rpartition(".")[2] for t in hf.get("target_parameters") or []}
    if parameters - set(EXPERT_WEIGHTS):
        raise CheckpointError(f"{file}: target_parameters {hf['target_parameters']!r} is not "
                              f"supported (MoE experts' {' and '.join(EXPERT_WEIGHTS)})")
    targets = {*targets, *(("gate_proj", "up_proj") if "gate_up_proj" in parameters else ()),
               *(("down_proj",) if "down_proj" in parameters else ())}
    if not targets:
        raise CheckpointError(f"{file}: no target_modules or target_parameters")
    # peft lists a saved module by its name and its path ("embed_tokens", "model.embed_tokens")
    saved = {m.rpartition(".")[2] for m in hf.get("modules_to_save") or []}
    if saved - {"embed_tokens", "lm_head"}:
        raise CheckpointError(f"{file}: modules_to_save {hf['modules_to_save']!r} is not "
                              "supported (embed_tokens, lm_head)")
    try:
        lora = LoraConfig(rank=int(hf["r"]), alpha=float(hf["lora_alpha"]),
                          rslora=bool(hf.get("use_rslora", False)), targets=tuple(sorted(targets)),
                          dropout=float(hf.get("lora_dropout", 0.0)),
                          modules_to_save=tuple(sorted(saved)))
    except KeyError as e:
        raise CheckpointError(f"{file}: missing field {e.args[0]!r}") from None
    # the only rank and alpha patterns: those peft gives the experts' fused gate-up adapter
    fused = "gate_up_proj" in parameters
    for key, value in (("rank_pattern", 2 * lora.rank), ("alpha_pattern", 2 * lora.alpha)):
        if (hf.get(key) or {}) != ({_FUSED: value} if fused else {}):
            raise CheckpointError(f"{file}: {key}={hf[key]!r} is not supported (only "
                                  f"{{{_FUSED!r}: {value}}} with the experts' gate_up_proj)")
    return lora, hf.get("base_model_name_or_path")


def load_adapter(model: Decoder, path: str | Path) -> Decoder:
    """`model`'s base weights under the adapters of the PEFT directory `path`."""
    path = Path(path)
    lora, _ = read_adapter_config(path)
    file = path / WEIGHTS_FILE
    tied = model.config.tie_embeddings and "embed_tokens" in lora.modules_to_save
    if tied and not read_json(path / CONFIG_FILE, "a PEFT adapter directory").get(
            "ensure_weight_tying"):
        # peft then trains the table's copy under the base's head: a model we cannot express
        raise CheckpointError(f"{path / CONFIG_FILE}: modules_to_save embed_tokens on a tied "
                              "model needs ensure_weight_tying: true")
    if not file.exists():
        raise CheckpointError(f"{file}: not found")
    # peft also saves the embedding and head layers whole when it adapts them (in case their
    # vocabulary was resized): the base's own weights, not adapters.
    tensors = {k: v for k, v in load_file(str(file)).items()
               if not k.endswith(".base_layer.weight")}
    cfg = dataclasses.replace(model.config, lora=lora)
    _, factors, _ = split_adapters(_abstract(cfg))
    flat = dict(nnx.to_flat_state(factors))
    if tied:  # the head's copy is the table's
        tensors.pop(_saved_key("lm_head"), None)
    for p, var in flat.items():
        if isinstance(var, SavedParam):
            name = next(n for n in lora.modules_to_save if WEIGHT_OF[n] == p[0])
            if _saved_key(name) not in tensors:
                raise CheckpointError(f"{file}: missing tensor {_saved_key(name)!r}")
            x = tensors.pop(_saved_key(name))
            expected = var.shape[::-1] if name == "lm_head" else var.shape  # our head: [D, V]
            if x.shape != expected:
                raise CheckpointError(f"{file}: tensor {_saved_key(name)!r} has shape "
                                      f"{x.shape}, expected {expected}")
            var.set_value(jnp.asarray(x.T if name == "lm_head" else x, var.dtype))
            continue
        key, expert = _hf_key(p, var, lora), isinstance(var, ExpertLoraParam)
        if key not in tensors:
            raise CheckpointError(f"{file}: missing tensor {key!r}")
        x = tensors.pop(key)
        expected = _to_peft(p, np.zeros(var.shape, np.float32), expert).shape
        if x.shape != expected:
            raise CheckpointError(f"{file}: tensor {key!r} has shape {x.shape}, expected "
                                  f"{expected} from the model and r={lora.rank}")
        var.set_value(jnp.asarray(_from_peft(p, x, var.shape, expert), jnp.float32))
    if tensors:
        raise CheckpointError(f"{file}: tensors the model has no place for, e.g. "
                              f"{next(iter(tensors))!r}")
    return with_adapters(model, lora, nnx.from_flat_state(flat))
