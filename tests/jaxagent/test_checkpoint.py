import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.checkpoint import Checkpointer
from jaxagent.metrics import MetricsWriter, read_metrics


def test_keeps_last_n_and_restores_exactly(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    state = {"w": jnp.arange(7.0), "nested": {"b": jnp.ones((3, 5), jnp.bfloat16)}}
    for step in (1, 2, 3):
        ckpt.save(step, jax.tree.map(lambda x: x * step, state), {"step": step, "data": [step]})
    ckpt.wait()
    assert ckpt.latest_step() == 3
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["2", "3"]
    restored, extra = ckpt.restore(3, state)
    np.testing.assert_array_equal(restored["w"], np.arange(7.0) * 3)
    assert restored["nested"]["b"].dtype == jnp.bfloat16 and extra == {"step": 3, "data": [3]}
    ckpt.close()


def test_partial_restore_reads_the_named_arrays_onto_their_shardings(tmp_path):
    """What `eval` of a run's workdir restores: the policy, not the optimizer state."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rng = np.random.default_rng(3)
    w = rng.normal(size=(8, 6)).astype(np.float32)
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(5, {"params": {"w": jnp.asarray(w)}, "opt_state": {"mu": jnp.ones((8, 6))}},
              {"step": 5})
    ckpt.close()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sharding = NamedSharding(mesh, PartitionSpec("a", "b"))
    like = {"params": {"w": jax.device_put(jnp.zeros((8, 6)), sharding)}}
    ckpt = Checkpointer(tmp_path / "ckpt")
    step, restored, extra = ckpt.restore_newest(like, set_aside=False, partial=True)
    ckpt.close()
    assert (step, extra, list(restored)) == (5, {"step": 5}, ["params"])
    assert restored["params"]["w"].sharding == sharding
    np.testing.assert_array_equal(restored["params"]["w"], w)


def test_metrics_resume_drops_rows_after_the_checkpoint(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 6):
        writer.write(step, {"train/loss": step / 10})
    writer.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "train/lo')  # a line cut short by a kill
    resumed = MetricsWriter(tmp_path, resume_step=3, tensorboard=False)
    resumed.write(4, {"train/loss": float("nan")})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["train/loss"] is None


def _damage_newest(directory, step):
    """Truncate every array file of checkpoint `step`'s state (what a bad disk or copy leaves)."""
    files = [f for f in (directory / str(step) / "state").rglob("*") if f.is_file()
             and f.stat().st_size > 0 and not f.name.startswith("_")]
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def test_restore_newest_skips_a_damaged_checkpoint_and_keeps_it(tmp_path):
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory, keep=3)
    state = {"w": jnp.arange(11.0)}
    for step in (1, 2, 3):
        ckpt.save(step, {"w": state["w"] * step}, {"step": step})
    ckpt.close()
    _damage_newest(directory, 3)

    said = []
    ckpt = Checkpointer(directory, keep=3)
    step, restored, extra = ckpt.restore_newest(state, report=said.append)
    assert step == 2 and extra == {"step": 2}
    np.testing.assert_array_equal(restored["w"], np.arange(11.0) * 2)
    assert len(said) == 1 and "step 3" in said[0] and "\n" not in said[0]
    assert (tmp_path / "ckpt.corrupt" / "3" / "state").is_dir()  # set aside, never deleted
    # The resumed run saves step 3 again where the damaged one was.
    ckpt.save(3, {"w": state["w"] * 30}, {"step": 3})
    ckpt.wait()
    assert ckpt.restore_newest(state)[0] == 3
    ckpt.close()


def test_restore_newest_with_no_good_checkpoint_is_one_line(tmp_path):
    import pytest

    from jaxagent.checkpoint import CheckpointError

    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory)
    assert ckpt.restore_newest({"w": jnp.zeros(3)}) is None  # nothing saved: a fresh start
    ckpt.save(1, {"w": jnp.ones(3)}, {"step": 1})
    ckpt.close()
    _damage_newest(directory, 1)
    with pytest.raises(CheckpointError, match="no checkpoint restores") as e:
        Checkpointer(directory).restore_newest({"w": jnp.zeros(3)}, report=lambda _: None)
    assert "\n" not in str(e.value)
