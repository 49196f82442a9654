"""End to end: `jaxagent train` on a tiny model, killed with SIGKILL after a checkpoint and
re-run, trains each step exactly once and matches an uninterrupted run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxagent.config import ConfigError, load_config
from jaxagent.metrics import read_metrics

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "sft.steps=3", "sft.batch_size=8", "train.steps=4", "train.prompts_per_step=2",
        "rl.group_size=4", "train.max_new_tokens=8", "tasks.num_train=50", "tasks.num_eval=3",
        "eval.samples=2", "checkpoint.every=1", "rewards.workers=1",
        "sampler.prompt_bucket=64", "sampler.cache_bucket=16"]


def train_cmd(workdir):
    return [sys.executable, "-m", "jaxagent.cli", "train", *TINY, f"workdir={workdir}"]


def losses(workdir):
    rows = [r for r in read_metrics(Path(workdir) / "metrics.jsonl") if "train/loss" in r]
    return [(r["step"], r["train/loss"], r["rollout/reward_mean"]) for r in rows]


def test_kill_and_resume_trains_each_step_once(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    straight = tmp_path / "straight"
    subprocess.run(train_cmd(straight), check=True, env=env, capture_output=True)

    run = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(run), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "2").is_dir():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint 2 appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(train_cmd(run), check=True, env=env, capture_output=True, text=True)
    assert "Resuming from checkpoint step" in resumed.stderr

    got, want = losses(run), losses(straight)
    assert [s for s, _, _ in got] == [1, 2, 3, 4]  # each step exactly once
    assert got == want  # same rollouts and the same updates as the uninterrupted run
    assert (run / "curves.png").exists() and (run / "config.yaml").exists()
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 4]


@pytest.mark.parametrize("override, message", [
    ("train.micro_batch=5", "train.micro_batch: must divide the batch"),
    ("rl.group_size=1", "rl.group_size: must be >= 2"),
    ("eval.k=[1, 8]", "eval.k: needs eval.samples >= max(k)"),
    ("tasks.source=jsonl", "tasks.path: required for jsonl"),
])
def test_semantic_config_errors_fail_before_compute(tmp_path, override, message):
    from jaxagent.trainer import train

    with pytest.raises(ConfigError, match=re.escape(message)):
        train(load_config(None, [override, f"workdir={tmp_path}"]))
    assert not (tmp_path / "config.yaml").exists()


def test_bad_config_fails_before_compute(tmp_path):
    with pytest.raises(ConfigError, match="rl.algorithm: 'ppo' is not one of"):
        load_config(None, ["rl.algorithm=ppo"])
    proc = subprocess.run([sys.executable, "-m", "jaxagent.cli", "train", "train.stepz=3",
                           f"workdir={tmp_path}"], capture_output=True, text=True)
    assert proc.returncode == 2 and "train.stepz: unknown key" in proc.stderr
    assert not (tmp_path / "config.yaml").exists()


MOE = ["model.family=qwen3_moe", "model.num_experts=3", "model.num_experts_per_tok=2",
       "model.moe_intermediate_size=24"]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_sft_then_eval_cli(tmp_path, capsys, moe):
    from jaxagent.cli import main

    small = [o for o in TINY if not o.startswith(("sft.steps", "checkpoint"))] + (MOE if moe else [])
    assert main(["sft", *small, "sft.steps=2", f"workdir={tmp_path}"]) == 0
    exported = json.loads((tmp_path / "sft" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    assert exported.get("num_experts") == (3 if moe else None)
    out = tmp_path / "eval.jsonl"
    assert main(["eval", "--checkpoint", str(tmp_path / "sft"), "--tasks", "synthetic:3:5",
                 "--k", "1,2", "--samples", "2", "--out", str(out), *small]) == 0
    printed = capsys.readouterr().out
    assert "pass@1:" in printed and "pass@2:" in printed
    rows = [line for line in out.read_text().splitlines() if line]
    assert len(rows) == 6  # 3 tasks x 2 samples
