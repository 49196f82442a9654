"""Runs never lose or corrupt work: one run per workdir, a changed config is refused before
anything is written, a damaged newest checkpoint falls back to the previous one, and logs
hold each step once after a resume."""

from __future__ import annotations

import os
import socket

import pytest

from jaxagent.cli import main
from jaxagent.config import load_config, save_config
from jaxagent.metrics import read_metrics
from jaxagent.workdir import workdir_lock

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "sft.steps=2", "sft.batch_size=8", "train.steps=2", "train.prompts_per_step=2",
        "rl.group_size=4", "train.max_new_tokens=8", "tasks.num_train=20", "tasks.num_eval=0",
        "eval.every=0", "checkpoint.every=1", "rewards.workers=1", "train.log_rollouts=2",
        "sampler.prompt_bucket=64", "sampler.cache_bucket=16"]


def test_a_busy_workdir_is_refused_naming_the_holder(tmp_path, capsys):
    with workdir_lock(tmp_path):
        assert main(["train", *TINY, f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"in use by a run on {socket.gethostname()} pid {os.getpid()}" in err
    assert err.count("\n") == 1 and not (tmp_path / "config.yaml").exists()


def test_a_changed_config_is_refused_before_anything_is_written(tmp_path, capsys):
    from jaxagent.train.build import resolve_attention, validate

    # what a run saves: the validated config with its attention backend resolved
    save_config(resolve_attention(validate(load_config(None, [*TINY, f"workdir={tmp_path}"]))),
                tmp_path / "config.yaml")
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    saved = (tmp_path / "config.yaml").read_text()
    assert main(["train", *TINY, "model.num_layers=2", "rl.clip_high=0.3", f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "resuming a run with a different config (model.num_layers: 1 -> 2; rl.clip_high:" in err
    assert err.count("\n") == 1 and (tmp_path / "config.yaml").read_text() == saved
    assert main(["train", *TINY, "train.steps=5", f"workdir={tmp_path}"]) == 2
    assert "(train.steps: 2 -> 5); pass checkpoint.allow_changes=true" in capsys.readouterr().err


def _damage(checkpoint):
    for f in (checkpoint / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and not f.name.startswith("_"):
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def test_a_damaged_checkpoint_falls_back_and_logs_stay_once_per_step(tmp_path, capsys):
    run = tmp_path / "run"
    # (this run also traces step 2's update: train.profile_steps)
    assert main(["train", *TINY, "train.profile_steps=[2]", f"workdir={run}"]) == 0
    assert len(list((run / "profile").rglob("*.xplane.pb"))) == 1
    _damage(run / "checkpoints" / "2")
    capsys.readouterr()
    assert main(["train", *TINY, "train.profile_steps=[2]", "train.steps=3",
                 "checkpoint.allow_changes=true", f"workdir={run}"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint step 2 does not restore" in err and "Resuming from checkpoint step 1" in err
    assert (run / "checkpoints.corrupt" / "2").is_dir()  # set aside, never deleted
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3]
    logged = [r["step"] for r in read_metrics(run / "rollouts.jsonl")]
    assert logged == [1, 1, 2, 2, 3, 3]  # step 2's rollouts from the first run were dropped
    # a run's workdir is a model for generate, as for eval
    assert main(["generate", "--model", str(run), "--prompt", "def f(", "--max-new-tokens", "4"]) == 0


@pytest.mark.parametrize("lines, overrides, message", [
    (20, [], "tasks.num_eval: 200 held-out tasks would leave none of the 20 in"),
    (0, ["tasks.num_eval=0"], "holds no tasks"),
    (20, ["tasks.num_eval=5", "sft.steps=-3"], "sft.steps: must be >= 0"),
])
def test_small_or_empty_task_files_and_bad_counts_are_one_line(tmp_path, capsys, lines, overrides,
                                                              message):
    import json

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": i, "prompt": "def f(x):\n", "entry_point": "f",
                                         "tests": ["assert f(1) == 1"], "reference": "    return x\n"})
                             + "\n" for i in range(lines)))
    small = [o for o in TINY if not o.startswith("tasks.num_eval")]
    assert main(["train", *small, "tasks.source=jsonl", f"tasks.path={tasks}", *overrides,
                 f"workdir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# Fault injection: SIGKILL at random moments (start-up, SFT, sampling, rewards, the update, a
# checkpoint save), resume, repeat; the finished run must equal an uninterrupted one.

# The entropy bonus moves the policy even when every reward of the tiny model is 0, so the
# losses compared below differ from step to step.
FAULT_RUN = [o for o in TINY if not o.startswith(("train.steps", "tasks.num_eval", "eval.every"))] + [
    "train.steps=4", "tasks.num_eval=3", "eval.samples=2", "eval.every=2", "rl.entropy_coef=0.05"]


def _train(workdir):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "jaxagent.cli", "train", *FAULT_RUN,
                             f"workdir={workdir}"], env={**os.environ, "XLA_FLAGS": ""},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _run_with_kills(workdir, kills: int, seed: int, span: float = 600.0) -> int:
    """Train to the end, SIGKILLing the run `kills` times, each at a random moment of the first
    `span` seconds of a run (a run's length: start-up, SFT, sampling, rewards, updates and
    checkpoint saves all get hit); the kills that landed (a run may finish before its kill)."""
    import random
    import signal
    import subprocess

    rng, landed = random.Random(seed), 0
    while True:
        proc = _train(workdir)
        try:
            _, err = proc.communicate(timeout=rng.uniform(0.02, 0.95) * span if landed < kills
                                      else 600)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            landed += 1
            continue
        assert proc.returncode == 0, err[-2000:]
        return landed


def _record(workdir):
    rows = read_metrics(workdir / "metrics.jsonl")
    return ([(r["step"], r["train/loss"], r["rollout/reward_mean"]) for r in rows if "train/loss" in r],
            [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r],
            [r["step"] for r in read_metrics(workdir / "rollouts.jsonl")])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run's record, and the wall time of a run once its programs are in the
    compilation cache (as the killed runs' will be)."""
    import time

    assert _run_with_kills(tmp_path_factory.mktemp("straight"), 0, 0) == 0  # compiles
    workdir = tmp_path_factory.mktemp("straight")
    t0 = time.monotonic()
    assert _run_with_kills(workdir, 0, 0) == 0
    return _record(workdir), time.monotonic() - t0


def _check_survives(tmp_path, uninterrupted, kills, seed):
    """Kill runs until `kills` kills have landed (a resumed run is shorter, so one may finish
    before its kill: then a fresh run takes the rest), checking every finished run against the
    uninterrupted one; the kills survived."""
    uninterrupted, span = uninterrupted
    landed, attempt = 0, 0
    while landed < kills:
        # a fresh workdir and seed each round: a round whose run finished before its kill (the
        # machine got faster than when `span` was measured) would otherwise replay the same
        # kill times on the finished run, forever
        workdir = tmp_path / f"run{attempt}"
        landed += _run_with_kills(workdir, kills - landed, seed + 1000 * attempt, span)
        attempt += 1
        got = _record(workdir)
        losses, evals, logged = got
        assert [s for s, *_ in losses] == [1, 2, 3, 4] and [s for s, _ in evals] == [0, 2, 4]
        assert logged == sorted(logged) and set(logged) == {1, 2, 3, 4}
        assert len({loss for _, loss, _ in losses}) == 4  # the steps did train
        assert got == uninterrupted  # same updates, evaluations and logged rollouts
        assert not (workdir / "checkpoints.corrupt").exists()
        assert max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == 4
    return landed


def test_runs_survive_kills(tmp_path, uninterrupted):
    assert _check_survives(tmp_path, uninterrupted, kills=2, seed=1) == 2


@pytest.mark.slow
def test_runs_survive_twenty_kills(tmp_path, uninterrupted):
    assert _check_survives(tmp_path, uninterrupted, kills=20, seed=2) == 20
