"""Where jax.distributed's processes come from: config, launcher variables, clusters."""

import pytest

from jaxagent.errors import ConfigError
from sharding.config import DistributedConfig
from sharding.distributed import detect, initialize, process_share

EXPLICIT = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
            "JAX_PROCESS_ID": "3"}


def test_single_process_by_default():
    assert detect(DistributedConfig(), {}) is None
    assert initialize(DistributedConfig(), {}) == "single process"
    assert detect(DistributedConfig(mode="off"), EXPLICIT) is None


def test_config_beats_environment():
    cfg = DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=1)
    assert detect(cfg, EXPLICIT) == ("config", {"coordinator_address": "h:1",
                                                "num_processes": 2, "process_id": 1})
    with pytest.raises(ConfigError, match="go together"):
        detect(DistributedConfig(num_processes=2), {})


def test_launcher_variables():
    assert detect(DistributedConfig(), EXPLICIT) == ("environment", {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3})
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID missing"):
        detect(DistributedConfig(), {k: v for k, v in EXPLICIT.items() if k != "JAX_PROCESS_ID"})
    with pytest.raises(ConfigError, match="must be integers"):
        detect(DistributedConfig(), {**EXPLICIT, "JAX_PROCESS_ID": "one"})


@pytest.mark.parametrize("env, how", [
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8"}, "slurm"),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "tpu"),
    ({"KUBERNETES_SERVICE_HOST": "k", "JOB_COMPLETION_INDEX": "0"}, "kubernetes"),
])
def test_clusters_are_left_to_jax_detection(env, how):
    assert detect(DistributedConfig(), env) == (how, {})


def test_one_task_slurm_job_is_single_process():
    assert detect(DistributedConfig(), {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "1"}) is None


@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 4, 7, 13])
def test_process_shares_cover_every_item_once_in_order(n, count):
    shares = [process_share(n, p, count) for p in range(count)]
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
