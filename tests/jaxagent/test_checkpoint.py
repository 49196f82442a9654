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
