import dataclasses
import subprocess
import sys

import pytest

from jaxagent.config import (Config, ConfigError, ModelConfig, apply_overrides, load_config,
                             save_config, to_yaml)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_are_the_tiny_model():
    cfg = load_config()
    assert cfg.model == ModelConfig()
    assert cfg.model.num_layers == 2 and cfg.model.vocab_size == 264


def test_parts_own_their_config_sections():
    # jaxagent.config composes the parts' sections; no part reaches back for the root config.
    parts = ["sharding.layout", "sharding.distributed", "jaxagent.models", "jaxagent.rl",
             "rollouts.sampler", "rollouts.rewards", "rollouts.agent", "rollouts.tasks.config",
             "jaxagent.train.config", "jaxagent.optim"]
    code = (f"import sys; import {', '.join(parts)}; "
            "assert 'jaxagent.config' not in sys.modules, 'a part imported jaxagent.config'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_repo_configs_load():
    cfg = load_config("configs/tiny.yaml")
    assert cfg.workdir == "runs/tiny"
    assert cfg.model == load_config(None, ["model=configs/model/tiny.yaml"]).model


def test_yaml_overrides_only_what_it_names(tmp_path):
    path = write(tmp_path, "x.yaml", "model:\n  num_layers: 3\n  rope_scaling: {factor: 2.5}\nseed: 7\n")
    cfg = load_config(path)
    assert cfg.model.num_layers == 3 and cfg.seed == 7
    assert cfg.model.rope_scaling.factor == 2.5
    assert cfg.model.hidden_size == ModelConfig().hidden_size


def test_included_section_is_relative_to_including_file(tmp_path):
    write(tmp_path, "sub/m.yaml", "num_layers: 5\n")
    path = write(tmp_path, "sub/top.yaml", "model: m.yaml\n")
    assert load_config(path).model.num_layers == 5


def test_a_config_starts_from_its_base(tmp_path):
    write(tmp_path, "b.yaml", "model:\n  num_layers: 3\n  num_heads: 6\nsampler:\n  top_k: 5\n"
          "seed: 7\nworkdir: runs/b\n")
    write(tmp_path, "sub/m.yaml", "num_layers: 5\n")
    path = write(tmp_path, "sub/top.yaml", "base: ../b.yaml\nmodel: m.yaml\n"
                 "sampler:\n  top_p: 0.8\nseed: 9\n")
    cfg = load_config(path, ["sampler.top_k=11"])
    # a section given as a file replaces the base's; one given as keys merges into it
    assert cfg.model == load_config(None, [f"model={tmp_path / 'sub/m.yaml'}"]).model
    assert (cfg.sampler.top_k, cfg.sampler.top_p, cfg.seed, cfg.workdir) == (11, 0.8, 9, "runs/b")


@pytest.mark.parametrize(("files", "message"), [
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, "a cycle"),
    ({"a.yaml": "base: [b.yaml]\n"}, "base: expected the path"),
    ({"a.yaml": "base: none.yaml\n"}, "config file 'none.yaml' not found"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "sede: 1\n"}, "b.yaml: sede: unknown key"),
])
def test_a_bad_base_is_named(tmp_path, files, message):
    for name, text in files.items():
        write(tmp_path, name, text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "a.yaml")


def test_the_bpe_agent_config_is_the_default_with_a_learnt_tokenizer():
    """configs/agent_bpe.yaml changes agent_default.yaml where it says, and nowhere else."""
    def leaves(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    bpe = dict(leaves(dataclasses.asdict(load_config("configs/agent_bpe.yaml"))))
    default = dict(leaves(dataclasses.asdict(load_config("configs/agent_default.yaml"))))
    model = dict(leaves(dataclasses.asdict(load_config(None, ["model=configs/model/tiny_bpe.yaml"]).model), "model."))
    assert {k for k in bpe if bpe[k] != default[k]} == {k for k in model if model[k] != default[k]} | {
        "agent.max_action_tokens", "agent.max_turns", "agent.episodes", "sft.valid_stop_by",
        "sft.valid_stop", "train.steps", "train.temperature", "train.micro_batch",
        "checkpoint.every", "eval.every", "tasks.mix.window", "tasks.mix.floor", "workdir"}
    assert bpe["model.tokenizer"] == "bpe" and bpe["train.steps"] == 60
    # episodes sampled hotter than the held-out evaluation reads them
    assert (bpe["train.temperature"], bpe["eval.temperature"]) == (0.8, 0.5)


def test_dotted_overrides_parse_yaml_scalars(tmp_path):
    cfg = load_config(None, ["model.num_layers=2", "workdir=/tmp/run", "model.qk_norm=false",
                             "sampler.top_k=null", "sampler.top_p=0.9", "model.rope_theta=5e5"])
    assert cfg.model.num_layers == 2 and cfg.workdir == "/tmp/run"
    assert cfg.model.qk_norm is False and cfg.sampler.top_k is None
    assert cfg.sampler.top_p == 0.9 and cfg.model.rope_theta == 5e5
    # An int is accepted where a float is expected, and stored as a float.
    assert isinstance(load_config(None, ["model.rope_theta=10"]).model.rope_theta, float)


def test_override_applies_after_file(tmp_path):
    path = write(tmp_path, "x.yaml", "model:\n  num_layers: 3\n")
    assert load_config(path, ["model.num_layers=6"]).model.num_layers == 6


def test_overrides_of_an_optional_section_add_up(tmp_path):
    cfg = load_config(None, ["sampler.mesh.expert=2", "sampler.mesh.tensor=4"])
    assert (cfg.sampler.mesh.expert, cfg.sampler.mesh.tensor) == (2, 4)
    path = write(tmp_path, "x.yaml", "sampler:\n  mesh:\n    tensor: 2\n")
    assert load_config(path, ["sampler.mesh.data=3"]).sampler.mesh.tensor == 2
    assert load_config(None, ["sampler.mesh=null"]).sampler.mesh is None


def test_unknown_key_names_path_and_file(tmp_path):
    path = write(tmp_path, "bad.yaml", "model:\n  num_layerz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value)
    assert "model.num_layerz: unknown key" in str(e.value)
    assert "did you mean 'num_layers'" in str(e.value)


def test_unknown_override_key_names_the_override():
    with pytest.raises(ConfigError, match=r"override 'model.nope=1'.*model.nope: unknown key"):
        load_config(None, ["model.nope=1"])


@pytest.mark.parametrize("text, where, what", [
    ("model:\n  num_layers: four\n", "model.num_layers", "expected int"),
    ("model:\n  num_layers: 2.5\n", "model.num_layers", "expected int"),
    ("model:\n  qk_norm: 1\n", "model.qk_norm", "expected bool"),
    ("model:\n  num_layers: true\n", "model.num_layers", "expected int"),
    ("model:\n  param_dtype: float16\n", "model.param_dtype", "not one of"),
    ("model: 3\n", "model", "expected a mapping"),
    ("sampler:\n  temperature: hot\n", "sampler.temperature", "expected float"),
    ("workdir: null\n", "workdir", "may not be null"),
])
def test_wrong_type_names_key_and_file(tmp_path, text, where, what):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"{path}: {where}: " in str(e.value) and what in str(e.value)


def test_wrong_type_in_override():
    with pytest.raises(ConfigError, match=r"override 'seed=abc'.*seed: expected int"):
        load_config(None, ["seed=abc"])
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        load_config(None, ["seed"])


def test_a_sections_own_checks_name_the_source(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'agent.max_turns=0'.*: agent: .*max_turns "
                                          "must be positive"):
        load_config(None, ["agent.max_turns=0"])
    path = write(tmp_path, "r.yaml", "rewards:\n  hack_penalty: -1\n")
    with pytest.raises(ConfigError, match=r"r.yaml: rewards: .*penalties must be >= 0"):
        load_config(path)


def test_bad_yaml_names_file(tmp_path):
    path = write(tmp_path, "broken.yaml", "model: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{path}: invalid YAML"):
        load_config(path)
    path = write(tmp_path, "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match=rf"{path}: top level must be a mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    path = write(tmp_path, "inc.yaml", "model: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"model: config file 'nowhere.yaml' not found"):
        load_config(path)


def test_save_and_reload_round_trip(tmp_path):
    cfg = apply_overrides(Config(), ["model.num_layers=3", "model.rope_scaling.rope_type=llama3",
                                     "sampler.top_k=40", "init_from=/ckpt", "eval.k=[1, 5]",
                                     "tasks.families=[add, mul]"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(path) == cfg
    assert "num_layers: 3" in to_yaml(cfg)


def test_configs_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().seed = 3


def test_default_yaml_is_the_builtin_default():
    # `jaxagent train` without a config file (an installed package outside the repo) must run
    # the same experiment as with configs/default.yaml.
    assert load_config("configs/default.yaml") == Config()


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-humaneval-grpo",
                                  "qwen2.5-coder-7b-humaneval-grpo"])
def test_real_model_configs_are_valid(name):
    cfg = load_config(f"configs/{name}.yaml")
    assert cfg.init_from.startswith("/checkpoints/Qwen2.5-Coder-")
    assert (cfg.model.param_dtype, cfg.model.dtype) == ("float32", "bfloat16")  # float32 masters
    assert cfg.tasks.source == "humaneval" and 0 < cfg.tasks.num_eval < 164
    assert cfg.train.prompts_per_step * cfg.rl.group_size % (cfg.train.micro_batch or 1) == 0
    assert max(cfg.eval.k) <= cfg.eval.samples
    assert cfg.optim.learning_rate < 1e-5  # full fine-tuning of a pretrained model
    assert cfg.workdir.endswith(name)


def test_document_attention_config_is_valid():
    from jaxagent.train.build import validate

    cfg = load_config("configs/doc_tiny.yaml")
    assert cfg.model.attention == "doc" and cfg.sft.data == "documents"
    validate(cfg)


def test_attention_backend_is_checked_on_the_runs_rows_and_named_when_one_fits(monkeypatch):
    """validate() tries `model.attention_backend` on every row layout the run attends over
    (RL rows, SFT rows, the sampler's cached calls) without asking JAX anything;
    resolve_attention() (once JAX has started) saves `auto` as the one backend that does what
    auto does on all of them, or as auto where they need different ones."""
    from jaxagent.train.build import resolve_attention, validate

    import jax

    def started(*_):
        raise AssertionError("validate() started JAX's backends (jax.distributed could not start)")

    monkeypatch.setattr(jax, "default_backend", started)
    monkeypatch.setattr(jax, "device_count", started)
    unshared = ["train.share_prompt=false"]
    for backend in ("splash", "cudnn"):
        with pytest.raises(ValueError, match=f"model.attention_backend: {backend} runs causal rows only"):
            validate(apply_overrides(Config(), [f"model.attention_backend={backend}"]))  # shared
        assert validate(apply_overrides(Config(), [f"model.attention_backend={backend}", *unshared])
                        ).model.attention_backend == backend
    with pytest.raises(ValueError, match="model.attention_backend: cudnn runs causal rows only"):
        validate(apply_overrides(Config(), ["model.attention_backend=cudnn", *unshared,
                                            "sft.steps=1", "sft.data=documents"]))

    monkeypatch.undo()

    def resolved(platform, *overrides, devices=1):
        cfg = apply_overrides(Config(), list(overrides))
        return resolve_attention(cfg, platform, devices).model.attention_backend

    bf16 = "model.dtype=bfloat16"
    assert resolved("cpu") == resolved("cpu", *unshared) == "xla"
    assert resolved("gpu", bf16, *unshared) == "cudnn"  # causal rows; cached: pallas under both
    assert resolved("gpu", bf16) == "auto"  # shared-prompt rows: pallas; SFT's causal rows: cudnn
    assert resolved("gpu", bf16, "sft.steps=0") == "pallas"  # shared-prompt rows, cached calls
    assert resolved("gpu", *unshared) == "pallas"  # float32 causal rows and cached calls
    assert resolved("gpu", "model.attention=doc") == "pallas"
    assert resolved("gpu", bf16, *unshared, "sft.steps=1", "sft.data=documents") == "auto"
    assert resolved("tpu", *unshared) == "splash"
    assert resolved("tpu", *unshared, devices=4) == "xla"  # splash runs on one chip only
    assert resolved("gpu", "model.attention_backend=xla") == "xla"  # explicit: kept


def test_one_rollout_temperature_and_no_kl_across_truncated_supports():
    """train.temperature sets the rollouts' temperature; a sampler.temperature that says
    otherwise, or a KL penalty with top-k / top-p, is an error naming the keys."""
    import glob

    from jaxagent.train.build import validate

    validate(apply_overrides(Config(), ["train.temperature=0.6", "sampler.top_k=20",
                                        "sampler.top_p=0.95"]))
    validate(apply_overrides(Config(), ["train.temperature=0.6", "sampler.temperature=0.6"]))
    with pytest.raises(ConfigError, match="sampler.temperature.*train.temperature"):
        validate(apply_overrides(Config(), ["train.temperature=0.6", "sampler.temperature=0.8"]))
    with pytest.raises(ConfigError, match="rl.kl_coef.*sampler.top_k / sampler.top_p"):
        validate(apply_overrides(Config(), ["rl.kl_coef=0.01", "sampler.top_p=0.9"]))
    for path in sorted(glob.glob("configs/*.yaml")):  # every shipped experiment passes
        validate(load_config(path))


def test_pack_tokens_is_checked_against_the_settings_it_cannot_join():
    """train.pack_tokens packs rows its own way: not with shared-prompt rows, not with NSA
    (which reads no segment ids), not with a causal-rows-only kernel; its micro-batches count
    packed rows, so they need not divide the batch of rollouts."""
    from jaxagent.train.build import validate

    packed = ["train.pack_tokens=4096", "train.share_prompt=false"]
    validate(apply_overrides(Config(), [*packed, "train.micro_batch=3"]))
    with pytest.raises(ConfigError, match="train.pack_tokens: cannot be combined with "
                                          "train.share_prompt"):
        validate(apply_overrides(Config(), ["train.pack_tokens=4096"]))
    with pytest.raises(ConfigError, match="train.pack_tokens: must be >= 0"):
        validate(apply_overrides(Config(), ["train.pack_tokens=-1", "train.share_prompt=false"]))
    with pytest.raises(ConfigError, match="train.pack_tokens: needs attention that reads "
                                          "segment ids"):
        validate(apply_overrides(Config(), [*packed, "model.attention=nsa"]))
    with pytest.raises(ValueError, match="model.attention_backend: cudnn runs causal rows only"
                                         ".*train.pack_tokens"):
        validate(apply_overrides(Config(), [*packed, "model.attention_backend=cudnn"]))
