"""Typed experiment configs: nested dataclasses, YAML files and `key.sub=value` overrides.

A config is a tree of dataclasses whose defaults form the embedded tiny default run. YAML files
in `configs/` override any subset of it; a nested section may also be given as the path of a
YAML file (`model: model/tiny.yaml`, relative to the including file). Every value is checked
against the field's type, and every error names the key path and the file it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxagent.errors import UserError


class ConfigError(UserError):
    """A config value or file is invalid; the message names the key path and its source."""


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
    # Branches run as Pallas kernels (training and prefill; decoding stays XLA): "auto" is the
    # selected branch on GPU/TPU and none on CPU; "select"; "all" adds the window and the
    # compressed branch with block scoring; "xla" none. On CPU kernels run interpreted (slow:
    # for checks).
    kernels: Literal["auto", "xla", "select", "all"] = "auto"
    # GPU kernels of the three branches: Triton, or Mosaic GPU for Hopper (TMA + wgmma; bf16,
    # head dims of 64/128, selection blocks of 64, l'/d <= 4; else, and before Hopper, Triton).
    # Not yet compiled on hardware.
    gpu_kernels: Literal["triton", "mosaic"] = "triton"


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


@dataclass(frozen=True)
class ModelConfig:
    """A Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral decoder. Defaults: the tiny byte-level
    model for CPU runs."""

    # HF architecture written on export.
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"] = "qwen3"
    vocab_size: int = 264  # 256 bytes + specials, padded to a multiple of 8
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
    attention_backend: str = "xla"  # key of jaxagent.models.attention.BACKENDS (dense attention)
    # dense: `attention_backend`; nsa: Native Sparse Attention, see `nsa`; doc: the Pallas
    # document-attention kernel (pallas_kernels/doc_attention), prompts laid out by `documents`.
    attention: Literal["dense", "nsa", "doc"] = "dense"
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


# Logical axis -> mesh axes. Parameters and activations name their dimensions with logical
# axes; a dimension takes the listed mesh axes that divide it and that no earlier dimension of
# the same array uses. Names not listed are replicated.
DEFAULT_AXIS_RULES: tuple[tuple[str, ...], ...] = (
    ("batch", "data", "fsdp"),  # activations: the batch over all data-parallel devices
    ("embed", "fsdp"),  # FSDP: weights' model dimension split, gathered per use
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
)


@dataclass(frozen=True)
class MeshConfig:
    """A device mesh (data, fsdp, expert, tensor); -1 takes the devices the others leave."""

    data: int = -1  # pure data parallel (replicated weights)
    fsdp: int = 1  # data parallel with weights and optimizer state sharded on `embed`
    tensor: int = 1  # tensor parallel (heads, mlp, vocab): keep within fast links
    expert: int = 1  # expert parallel (MoE experts)
    dcn_data: int = 1  # of `data`, replicas over slow links (TPU slices, GPU nodes)
    rules: tuple[tuple[str, ...], ...] = DEFAULT_AXIS_RULES  # [logical, mesh axes...] rows


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process start-up (`jax.distributed`); explicit fields beat the environment."""

    # auto: explicit fields, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID,
    # else a detected TPU pod, SLURM job or Kubernetes JobSet, else one process. off: one.
    mode: Literal["auto", "off"] = "auto"
    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = 300  # waiting for every process to join
    heartbeat_timeout_s: int = 60  # a peer silent this long stops all the others


@dataclass(frozen=True)
class SamplerConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    # Prompt and cache lengths are rounded up to these multiples so jitted shapes repeat.
    prompt_bucket: int = 64
    cache_bucket: int = 64
    batch_bucket: int = 8
    # CPU only: threads a call's batch is split over (each decodes its rows; 1.4x at batch 32
    # on 2 cores); None = the cores this process may use. Ignored on accelerators and meshes.
    host_threads: int | None = None
    # The sampler's own mesh (e.g. pure tensor parallel); None: the trainer's mesh. Weights
    # are resharded onto it after each update.
    mesh: MeshConfig | None = None


@dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 5e-4  # right for the tiny default; pretrained models want ~1e-6
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"  # after warmup
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # global-norm clipping; 0 disables


@dataclass(frozen=True)
class RLConfig:
    # grpo: (r - mean) / std; dr_grpo: r - mean with a constant length normaliser;
    # rloo: leave-one-out baseline; dapo: grpo + clip-higher + dynamic sampling.
    # Validation fills each None below from the algorithm's preset (jaxagent/rl/algorithms.py);
    # a value set here wins, and the run's config.yaml holds the values used.
    algorithm: Literal["grpo", "rloo", "dr_grpo", "dapo"] = "grpo"
    group_size: int = 8  # G completions per prompt
    # Advantage baseline: the group's mean, or each member's mean of the others (rloo).
    baseline: Literal["mean", "leave_one_out"] | None = None
    normalize_std: bool | None = None  # divide advantages by the group's std (grpo, dapo)
    clip_low: float | None = None  # 0.2
    clip_high: float | None = None  # 0.2; dapo 0.28 (clip-higher)
    # token-mean; dr_grpo: seq-mean-token-sum-norm (over train.max_new_tokens)
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None
    kl_coef: float = 0.0  # > 0 keeps a frozen reference copy
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: float = 0.0  # > 0 bounds each token's KL estimate to [-kl_clamp, kl_clamp]; 0 = off
    # > 1 enables dual-clip: a negative-advantage token's loss is at most clip_ratio_c * |A|
    # (stale rollouts with off_policy: behaviour); 0 = off
    clip_ratio_c: float = 0.0
    entropy_coef: float = 0.0
    importance_cap: float = 2.0  # truncation of sampler -> trainer importance weights
    # decoupled: PPO ratio against the weights at the start of the update, times truncated
    # IS weights proximal/behaviour (AReaL); behaviour: PPO ratio against the sampler's logprobs.
    off_policy: Literal["decoupled", "behaviour"] = "decoupled"
    # Updates per batch: ppo_epochs passes over the batch cut into mini_batches (whole groups),
    # each a clipped step against the proximal log-probs taken once before the first. 1, 1:
    # one update per batch (the PPO clip then never acts: the ratio starts at 1).
    ppo_epochs: int = 1
    mini_batches: int = 1
    drop_zero_variance_groups: bool | None = None  # DAPO dynamic sampling (on for dapo)
    # With dynamic sampling: up to this many more draws of train.prompts_per_step tasks per
    # batch while it holds fewer groups with signal (rollout/groups_drawn, groups_kept); 0: off
    refill_draws: int = 0
    # DAPO soft overlong penalty over the last N of train.max_new_tokens (any algorithm; single
    # completions only); 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@dataclass(frozen=True)
class TasksConfig:
    source: Literal["synthetic", "humaneval", "jsonl"] = "synthetic"
    path: str | None = None  # jsonl file
    num_train: int = 4000  # synthetic only
    num_eval: int = 200  # held-out tasks (synthetic: a disjoint seed)
    families: tuple[str, ...] = ()  # synthetic families; empty = all


@dataclass(frozen=True)
class RewardsConfig:
    kind: Literal["all_pass", "fraction"] = "all_pass"
    hack_penalty: float = 0.0
    lint_penalty: float = 0.0
    backend: Literal["bwrap", "docker", "process"] = "bwrap"
    workers: int = 2


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    prompts_per_step: int = 16  # groups per step; the batch is prompts_per_step * group_size
    micro_batch: int = 0  # sequences per gradient-accumulation micro-batch; 0 = whole batch
    # The loss runs the LM head on chunks of tokens whose float32 logits take at most this
    # many MiB (each chunk rematerialised in the backward pass, so the [tokens, vocab] logits
    # never exist whole: 10 GiB for 16k tokens of a 152k vocabulary); 0 = no chunks.
    logits_chunk_mib: int = 1024
    max_new_tokens: int = 16
    temperature: float = 1.0
    log_rollouts: int = 4  # rollouts per step written to rollouts.jsonl
    profile_steps: tuple[int, ...] = ()  # steps whose update is traced into WORKDIR/profile
    # Pack each group as one row [prompt, completion_1..G] so the prompt is computed once
    # per group (same loss and gradients); ignored if the attention backend lacks it.
    share_prompt: bool = True


@dataclass(frozen=True)
class RolloutConfig:
    max_staleness: int = 1  # policy versions the sampler may run ahead; 0 = synchronous


@dataclass(frozen=True)
class DocumentDataConfig:
    """The synthetic retrieval family (rollouts/tasks/documents.py) for `sft.data: documents`."""

    num_documents: int = 4
    entries: int = 3  # key=value lines per document
    eval_examples: int = 256  # held out: answer accuracy before and after SFT


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 40  # supervised warm-up steps before RL (on the tasks' reference solutions)
    batch_size: int = 64
    learning_rate: float = 2e-3
    # tasks: imitate the training tasks' references. documents: the synthetic retrieval family
    # laid out for document attention, loss on the final section's answer. agent: scripted tool
    # episodes over agent.tasks (rollouts.agent.demos), loss on the actions only.
    data: Literal["tasks", "documents", "agent"] = "tasks"
    documents: DocumentDataConfig = field(default_factory=DocumentDataConfig)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 25  # steps; 0 = only at the end
    keep: int = 3
    # resume with changed train.steps / logging / eval / checkpoint settings (any other change
    # to a run's config is refused: jaxagent.workdir.check_resume_config)
    allow_changes: bool = False


@dataclass(frozen=True)
class EvalConfig:
    every: int = 25  # steps; 0 = before RL and at the end only
    samples: int = 4  # completions per task
    k: tuple[int, ...] = (1,)
    temperature: float = 1.0


@dataclass(frozen=True)
class AgentConfig:
    """Multi-turn tool episodes over repository tasks (rollouts.agent); mirrors AgentOptions."""

    enabled: bool = False  # train on agent episodes over agent.tasks instead of single completions
    # A directory of deletion tasks (DIR/ID/task.json; no held-out split), or `embedded:N[:SEED]`:
    # N tasks of the embedded agent family (rollouts.tasks.agent_family) minus its held-out fifth
    tasks: str = "rollouts/tasks/data/textkit_tasks"
    eval_tasks: int = 8  # held-out tasks of an embedded family that agent evaluation plays
    # The tools episodes offer (rollouts.tools.TOOLS names; empty: all). Fewer tools, a shorter
    # prompt: run_tests, read_file, edit, search, finish cut ~500 of the byte model's tokens.
    tools: tuple[str, ...] = ()
    call_format: Literal["hermes", "compact"] = "compact"  # hermes: Qwen <tool_call>; compact: @name {json}
    episodes: int = 8  # episodes in flight (sampler slots); a finished one's slot is refilled
    max_turns: int = 8
    max_context_tokens: int = 4096  # prompt + actions + observations
    max_action_tokens: int = 128  # tokens sampled per turn
    tool_timeout_s: float = 10.0  # one tool call's wall and CPU limit
    episode_timeout_s: float = 300.0
    max_output_chars: int = 2000  # a tool's output beyond this is cut (head + tail, with a note)
    truncation: Literal["mask", "penalty"] = "mask"  # budget-cut episodes: out of the advantage, or penalised
    truncation_penalty: float = 1.0
    zero_lookup_reward: bool = False  # episodes flagged by rollouts.agent.monitor earn at most 0
    memory: bool = True  # the memory tool's notes persist under WORKDIR/agent_memory
    embedding: Literal["ngram", "minilm"] = "ngram"  # semantic search; minilm: extra `semantic`
    feedback_detectors: tuple[str, ...] = ()  # bad_tool_call, test_edit, repeat
    feedback_beta: float = 0.0  # weight of KL(policy with hint || policy) at flagged turns
    # Flagged turns per step that get the KL (the batch's first ones): each costs a forward
    # pass over its context with and without the hint.
    feedback_max_examples: int = 4


@dataclass(frozen=True)
class Config:
    """The root of every experiment config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)  # the trainer's mesh
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    init_from: str | None = None  # HF checkpoint directory; None = random init of `model`
    workdir: str = "runs/default"
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain data, with type checks that name the key path.


def _where(path: str, source: str) -> str:
    return f"{source}: {path}" if path else source


def _check_scalar(tp: Any, value: Any, path: str, source: str) -> Any:
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `1e-6` (no dot) as a string; accept what Python reads as a float.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{_where(path, source)}: expected float, got {value!r}")
        return float(value)
    if tp in (int, str, bool):
        # bool is an int in Python; do not let True pass as an int or 1 as a bool.
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(
                f"{_where(path, source)}: expected {tp.__name__}, got {type(value).__name__} "
                f"{value!r}"
            )
        return value
    raise ConfigError(f"{_where(path, source)}: unsupported field type {tp!r}")


def _convert(tp: Any, value: Any, path: str, source: str, base_dir: Path | None) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str) and value.endswith((".yaml", ".yml")):
            return _from_file(tp, _resolve(value, base_dir, path, source), path)
        if not isinstance(value, dict):
            raise ConfigError(
                f"{_where(path, source)}: expected a mapping (or a .yaml path), got {value!r}"
            )
        return _build(tp, value, path, source, base_dir)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{_where(path, source)}: may not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path, source, base_dir)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{_where(path, source)}: "
                          f"{value!r} matches none of {tp}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{_where(path, source)}: {value!r} is not one of {', '.join(map(repr, choices))}"
            )
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_where(path, source)}: expected a list, got {value!r}")
        (item_tp, *rest) = typing.get_args(tp) or (Any,)
        items = [
            _convert(item_tp, v, f"{path}[{i}]", source, base_dir) for i, v in enumerate(value)
        ]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(path, source)}: expected a mapping, got {value!r}")
        return dict(value)
    if value is None:
        raise ConfigError(f"{_where(path, source)}: may not be null")
    return _check_scalar(tp, value, path, source)


def _build(cls: type, data: dict, path: str, source: str, base_dir: Path | None,
           base: Any = None) -> Any:
    """Make a `cls` from `data`, starting from `base` (an instance) or the defaults."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{_where(sub, source)}: unknown key{hint}")
        current = getattr(base, key) if base is not None else None
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict) and current is not None:
            values[key] = _build(hints[key], value, sub, source, base_dir, base=current)
        else:
            values[key] = _convert(hints[key], value, sub, source, base_dir)
    if base is not None:
        return dataclasses.replace(base, **values)
    return cls(**values)


def _resolve(name: str, base_dir: Path | None, path: str, source: str) -> Path:
    candidates = [Path(name)] if Path(name).is_absolute() else []
    if base_dir is not None:
        candidates.append(base_dir / name)
    candidates.append(Path.cwd() / name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{_where(path, source)}: config file {name!r} not found")


def _read_yaml(file: Path) -> dict:
    try:
        data = yaml.safe_load(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{file}: is a directory, not a YAML config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file}: not UTF-8 text (byte {e.start + 1})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: top level must be a mapping, got {type(data).__name__}")
    return data


def _from_file(cls: type, file: Path, path: str = "", base: Any = None) -> Any:
    return _build(cls, _read_yaml(file), path, str(file), file.parent, base=base)


# ---------------------------------------------------------------------------------------------
# Public API.


def from_dict(data: dict, cls: type = Config, source: str = "<dict>") -> Any:
    return _build(cls, data, "", source, None)


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply `a.b.c=value` strings; values are parsed as YAML scalars (`4`, `true`, `null`)."""
    for item in overrides:
        source = f"command-line override {item!r}"
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{source}: expected key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: invalid value: {e}") from None
        # Build the nested mapping {a: {b: {c: value}}} and merge it like a YAML file.
        for part in reversed(key.split(".")):
            value = {part: value}
        cfg = _build(type(cfg), value, "", source, Path.cwd(), base=cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls: type = Config):
    """The defaults, then the YAML file at `path` (if any), then the dotted overrides."""
    cfg = cls() if path is None else _from_file(cls, Path(path))
    return apply_overrides(cfg, list(overrides))


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML (loadable again with `load_config`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
    return path
