"""The async pipeline: staleness bound under random producer/consumer timing, checkpoint
snapshots, restored batches, token-exact trajectories, infrastructure failures."""

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from jaxagent.tokenizer import ByteTokenizer
from rollouts.environment import StepResult
from rollouts.orchestrator import Orchestrator, WeightStore
from rollouts.producer import (
    INFRA_ERROR,
    CodeTaskEnv,
    RolloutBatch,
    RolloutProducer,
    sample_and_score,
    sample_episodes,
)
from rollouts.rewards import Scorer
from rollouts.sampler import Sampler
from rollouts.tasks import synthetic_tasks


class Counter:
    """A task iterator with checkpointable state (the number drawn)."""

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return self.n

    def get_state(self):
        return self.n

    def set_state(self, n):
        self.n = n


class WeightsHolder:
    def update_weights(self, params):
        self.params = params


class TimedProducer:
    """Batches that take a random time to sample (in the producer thread) and to score (in a
    timer thread). Each batch's version is read from the weights the sampler actually held."""

    def __init__(self, rng: random.Random, delay: float):
        self.rng, self.delay = rng, delay
        self.sampler, self.tasks = WeightsHolder(), Counter()
        self.log = []  # (index, version the orchestrator asked for, version held)

    def start(self, index, version):
        next(self.tasks)
        time.sleep(self.rng.uniform(0, self.delay))
        held = int(self.sampler.params["version"])
        self.log.append((index, version, held))
        future = Future()
        batch = RolloutBatch(held, 1, [], {"index": index})
        threading.Timer(self.rng.uniform(0, self.delay), future.set_result, [batch]).start()
        return future

    def update_weights(self, params):
        self.sampler.update_weights(params)

    def task_state(self):
        return self.tasks.get_state()

    def close(self):
        pass


def publish(store, version):
    return store.publish(version, {"version": jnp.asarray(version)})


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_staleness_never_exceeds_the_bound_under_random_timing(k, seed):
    rng = random.Random(seed * 10 + k)
    producer = TimedProducer(random.Random(seed), delay=0.004)
    store = WeightStore.like({"version": jnp.asarray(0)})
    steps = 25
    publish(store, 0)
    staleness = []
    with Orchestrator(producer, store, max_staleness=k, start=0, stop=steps) as orch:
        for step in range(steps):
            batch, _ = orch.get(step)
            assert batch.stats["index"] == step
            staleness.append(step - batch.version)
            time.sleep(rng.uniform(0, 0.004))  # the "train step"
            assert len(store.versions()) <= k + 1  # only versions the producer may still need
            publish(store, step + 1)
    assert max(staleness) <= k
    # The version is fixed by the batch index: the pipeline fills, then stays exactly k behind.
    assert staleness == [min(step, k) for step in range(steps)]
    assert all(asked == held for _, asked, held in producer.log)


def test_snapshot_holds_the_next_k_batches_and_the_task_state_after_them():
    producer = TimedProducer(random.Random(0), delay=0.002)
    store = WeightStore.like({"version": jnp.asarray(0)})
    publish(store, 0)
    with Orchestrator(producer, store, max_staleness=2, start=0, stop=10) as orch:
        for step in range(3):
            orch.get(step)
            publish(store, step + 1)
        snap = orch.snapshot(3)
    # Steps 3 and 4 were sampled with versions 1 and 2 (older than the checkpoint's 3).
    assert [b["version"] for b in snap["queued"]] == [1, 2]
    assert [b["stats"]["index"] for b in snap["queued"]] == [3, 4]
    assert snap["data"] == 5  # batches 0..4 drew one task each; batch 5 is redrawn on resume


def test_restored_batches_are_trained_first_and_stale_ones_dropped():
    producer = TimedProducer(random.Random(0), delay=0.0)
    store = WeightStore.like({"version": jnp.asarray(0)})
    publish(store, 5)
    queued = [RolloutBatch(3, 1, [], {"index": "old"}), RolloutBatch(4, 1, [], {"index": "kept"})]
    with Orchestrator(producer, store, max_staleness=1, start=5, stop=7, queued=queued) as orch:
        batch, timing = orch.get(5)
        assert batch.stats["index"] == "kept" and timing["rollout/dropped_stale"] == 1
        publish(store, 6)
        batch, _ = orch.get(6)
        assert batch.version == 5 and batch.stats["index"] == 6


def test_producer_failure_reaches_the_trainer():
    producer = TimedProducer(random.Random(0), delay=0.0)
    producer.start = lambda index, version: 1 / 0
    store = WeightStore.like({"version": jnp.asarray(0)})
    publish(store, 0)
    with (Orchestrator(producer, store, max_staleness=1, start=0, stop=3) as orch,
          pytest.raises(RuntimeError, match="rollout producer failed")):
        orch.get(0)


def test_published_weights_are_a_copy_on_the_samplers_sharding():
    params = {"w": jnp.arange(7.0)}
    store = WeightStore.like(params)
    assert store.publish(0, params) >= 0
    store.publish(1, params)
    copy = store.take(1)
    params["w"].delete()  # what the train step's donation does to the trainer's buffer
    np.testing.assert_array_equal(copy["w"], np.arange(7.0))
    assert copy["w"].sharding == store.shardings["w"]
    assert store.versions() == [1]


# ---------------------------------------------------------------------------------------------
# Episodes through the real sampler and sandbox.

TINY = ModelConfig(vocab_size=264, hidden_size=32, intermediate_size=48, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def sampler():
    return Sampler(init_model(TINY, seed=3), ByteTokenizer(), prompt_bucket=64, cache_bucket=16)


def test_trajectory_tokens_equal_sampler_output(sampler):
    tok = ByteTokenizer()
    tasks = synthetic_tasks(3, seed=1)
    with Scorer(backend="bwrap", workers=2) as scorer:
        rollouts, stats = sample_and_score(sampler, tok, scorer, tasks, num_samples=2,
                                           max_new_tokens=7, temperature=1.0, seed=11, version=4)
    prompts = [tok.encode(t.prompt, add_bos=tok.add_bos) for t in tasks]
    out = sampler.generate(prompts, num_samples=2, max_new_tokens=7, temperature=1.0,
                           stop_token_ids=tok.stop_ids, seed=11)
    assert [r.completion for r in rollouts] == out.tokens
    for r, lps in zip(rollouts, out.logprobs):
        np.testing.assert_array_equal(np.float32(r.logprobs), lps)
        assert r.policy_mask == [True] * len(r.completion) and r.version == 4
    assert [r.prompt for r in rollouts] == [p for p in prompts for _ in range(2)]
    assert [r.text for r in rollouts] == [tok.decode(t) for t in out.tokens]
    assert all(r.status in ("passed", "failed", "error", "timeout") for r in rollouts)
    assert stats["rollout/infra_failures"] == 0


class FlakySandboxEnv(CodeTaskEnv):
    """Every other episode loses its sandbox connection mid-step."""

    count = 0

    def step(self, action):
        FlakySandboxEnv.count += 1
        if FlakySandboxEnv.count % 2:
            raise ConnectionError("sandbox worker died")
        return super().step(action)


def test_infrastructure_failures_are_counted_not_scored(sampler):
    tok = ByteTokenizer()
    with Scorer(backend="bwrap", workers=2) as scorer:
        producer = RolloutProducer(
            sampler, tok, scorer, iter(synthetic_tasks(4, seed=2)), prompts_per_step=2,
            group_size=3, max_new_tokens=5, temperature=1.0, seed=0,
            make_env=lambda: FlakySandboxEnv(tok, scorer))
        batch = producer.produce(0, version=0)
        producer.close()
    failed = [r for r in batch.rollouts if r.status == INFRA_ERROR]
    assert len(failed) == 3 and batch.stats["rollout/infra_failures"] == 3
    assert batch.valid().sum() == 3


class ScriptedRewardEnv(CodeTaskEnv):
    """Tasks whose id ends in an even digit reward every completion 0 (a group without
    signal); the others reward sum(tokens) % 7 (completions differ, so rewards do)."""

    def step(self, action):
        flat = int(self.task.id[-1]) % 2 == 0
        reward = 0.0 if flat else float(sum(action) % 7)
        return StepResult([], reward, True, {"status": "failed", "text": ""})


def test_dynamic_sampling_refills_groups_without_signal(sampler):
    """DAPO's dynamic sampling draws more groups until the batch holds prompts_per_step with
    signal (bounded by refill_draws), deterministically, and says how many it drew and kept."""
    tok = ByteTokenizer()
    tasks = synthetic_tasks(40, seed=5)
    assert sum(int(t.id[-1]) % 2 == 0 for t in tasks[:2]) >= 1  # the first draw lacks signal

    def produce(refill, batches=1):
        it = iter(tasks)
        producer = RolloutProducer(sampler, tok, None, it, prompts_per_step=2, group_size=3,
                                   max_new_tokens=5, temperature=1.0, seed=0, refill_draws=refill,
                                   make_env=lambda: ScriptedRewardEnv(tok, None))
        out = [producer.produce(i, version=0) for i in range(batches)]
        producer.close()
        return out, next(it)

    [plain], after_plain = produce(0)
    assert plain.groups_with_signal().sum() < 2 and "rollout/groups_drawn" not in plain.stats
    assert after_plain.id == tasks[2].id
    batches, after = produce(4, batches=2)
    for batch in batches:
        assert len(batch.rollouts) == 6 and batch.groups_with_signal().all()
        assert batch.stats["rollout/groups_kept"] == 2
        assert batch.stats["rollout/groups_drawn"] >= 4
    drawn = sum(b.stats["rollout/groups_drawn"] for b in batches)
    assert after.id == tasks[drawn].id  # the iterator moved by exactly the draws
    again, _ = produce(4, batches=2)  # deterministic: a resume repeats it
    assert [r.completion for b in again for r in b.rollouts] == \
        [r.completion for b in batches for r in b.rollouts]
    [capped], _ = produce(1)  # at most one more draw: what lacks signal fills the rest
    assert capped.stats["rollout/groups_drawn"] <= 4 and len(capped.rollouts) == 6


@pytest.mark.parametrize("graded", [range(1, 4), range(0)], ids=["rows 1-3", "none"])
def test_graded_rows_are_the_only_ones_stepped_and_returned(sampler, graded):
    """Every process samples the whole batch when the sampler's weights span them all, and
    steps its share: the rollouts of `graded` rows are those rows of the whole batch's."""
    tok = ByteTokenizer()
    tasks = synthetic_tasks(3, seed=6)  # the shapes of the test above: its compiled programs
    stepped = []

    class Recording(ScriptedRewardEnv):
        def step(self, action):
            stepped.append(self.task.id)
            return super().step(action)

    def run(rows):
        envs = [Recording(tok, None) for _ in range(len(tasks) * 2)]
        with ThreadPoolExecutor(4) as pool:
            return sample_episodes(sampler, envs, tasks, pool, num_samples=2, max_new_tokens=7,
                                   temperature=1.0, seed=2, graded=rows).result()

    whole, _ = run(None)
    stepped.clear()
    part, stats = run(graded)
    assert [r.to_json() for r in part] == [whole[i].to_json() for i in graded]
    assert sorted(stepped) == sorted(whole[i].task_id for i in graded)
    assert bool(stats) == bool(graded)
