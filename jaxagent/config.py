"""Typed experiment configs: nested dataclasses, YAML files and `key.sub=value` overrides.

A config is a tree of dataclasses whose defaults form the embedded tiny default run. YAML files
in `configs/` override any subset of it; a nested section may also be given as the path of a
YAML file (`model: model/tiny.yaml`, relative to the including file), and a file may start from
another (`base: agent_default.yaml`) and change some of its keys. Every value is checked
against the field's type, and every error names the key path and the file it came from.

Each part owns the section it reads (`model`: jaxagent.models.config, `mesh`/`distributed`:
sharding.config, `sampler`: rollouts.sampler.config, `rewards`: rollouts.rewards, `agent`:
rollouts.agent.config, `rl`: jaxagent.rl.config, `tasks`: rollouts.tasks.config, and the
trainer's own `optim`, `train`, `rollout`, `sft`, `checkpoint`, `eval`: jaxagent.train.config);
this module composes them into `Config` and loads YAML, and its names stay the public way to
reach them (`from jaxagent.config import ModelConfig`). It owns no section.
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

from jaxagent.errors import ConfigError
from jaxagent.models.config import ModelConfig
from jaxagent.rl.config import RLConfig
from jaxagent.train.config import (CheckpointConfig, EvalConfig,
                                   OptimizerConfig, RolloutConfig, SFTConfig, TrainConfig)
from rollouts.agent.config import AgentConfig
from rollouts.rewards import RewardConfig
from rollouts.sampler.config import SamplerConfig
from rollouts.tasks.config import TasksConfig
from sharding.config import DistributedConfig, MeshConfig


@dataclass(frozen=True)
class Config:
    """The root of every experiment config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
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
        # a section set already (an optional one too: `sampler.mesh`) takes the keys it is given
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            values[key] = _build(type(current), value, sub, source, base_dir, base=current)
        else:
            values[key] = _convert(hints[key], value, sub, source, base_dir)
    try:
        if base is not None:
            return dataclasses.replace(base, **values)
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as e:  # a section's own checks (__post_init__): one line with its source
        raise ConfigError(f"{_where(path, source)}: {e}") from None


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


def _from_file(cls: type, file: Path, path: str = "", base: Any = None,
               chain: tuple[Path, ...] = ()) -> Any:
    """`cls` from `file`. A file may start from another (`base: agent_default.yaml`, relative to
    it): that one's config, with this file's keys over it; a section given as a file replaces
    the base's section, one given as keys merges into it."""
    data = _read_yaml(file)
    if "base" in data and "base" not in {f.name for f in dataclasses.fields(cls)}:
        name = data.pop("base")
        if not isinstance(name, str):
            raise ConfigError(f"{file}: base: expected the path of a YAML config, got {name!r}")
        parent = _resolve(name, file.parent, "base", str(file))
        if parent.resolve() in chain or parent.resolve() == file.resolve():
            raise ConfigError(f"{file}: base: {name!r} leads back to {file.name} (a cycle)")
        base = _from_file(cls, parent, path, base, (*chain, file.resolve()))
    return _build(cls, data, path, str(file), file.parent, base=base)


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
