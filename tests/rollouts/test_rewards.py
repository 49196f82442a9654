from __future__ import annotations

import asyncio

import pytest

from rollouts.rewards import RewardConfig, Scorer, combine
from rollouts.sandbox import RunResult
from rollouts.tasks import synthetic_tasks


def _result(status, passed=0, total=4):
    return RunResult(status=status, tests_passed=passed, tests_total=total)


@pytest.mark.parametrize(
    ("config", "result", "lint", "reward"),
    [
        (RewardConfig(), _result("passed", 4), (), 1.0),
        (RewardConfig(), _result("failed", 3), (), 0.0),
        (RewardConfig(kind="fraction"), _result("failed", 3), (), 0.75),
        (RewardConfig(kind="fraction"), _result("timeout", 0), (), 0.0),
        (RewardConfig(kind="fraction", hack_penalty=0.5), _result("hack", 0), (), -0.5),
        (RewardConfig(lint_penalty=0.2), _result("passed", 4), ("F401 unused",), 0.8),
        (RewardConfig(lint_penalty=0.2), _result("passed", 4), (), 1.0),
    ],
)
def test_combine(config, result, lint, reward):
    out = combine("t", result, config, lint)
    assert out.reward == pytest.approx(reward)
    assert out.reward == pytest.approx(sum(out.breakdown.values()))
    assert set(out.breakdown) == {"tests", "hack", "lint"}


def test_config_is_validated():
    with pytest.raises(ValueError, match="kind must be"):
        RewardConfig(kind="best")
    with pytest.raises(ValueError, match="penalties must be >= 0"):
        RewardConfig(hack_penalty=-1)


def test_scorer_scores_a_batch_in_order_sync_and_async(bwrap_sandbox):
    tasks = synthetic_tasks(3, seed=4)
    completions = [
        tasks[0].metadata["reference"],
        "None\n",
        "__import__('os')._exit(0)\n",
    ]
    config = RewardConfig(kind="fraction", hack_penalty=1.0, lint_penalty=0.25)
    with Scorer(config, sandbox=bwrap_sandbox) as scorer:
        rewards = scorer.score_batch(tasks, completions)

        async def score_all():
            return await asyncio.gather(
                *(scorer.score(t, c) for t, c in zip(tasks, completions))
            )

        again = asyncio.run(score_all())
    assert [r.status for r in rewards] == ["passed", "failed", "hack"]
    assert [r.reward for r in rewards] == [1.0, 0.0, -1.0]
    assert [r.reward for r in again] == [1.0, 0.0, -1.0]
    # closing the scorer leaves a sandbox it did not create usable
    assert bwrap_sandbox.submit(tasks[0].request(completions[0])).result().passed


def test_identical_runs_share_one_verdict_but_timeouts_rerun(hostile_sandbox):
    # The hostile limits' 2 s wall: the timeouts below wait out 2 s each, not the default 10 s.
    task, other = synthetic_tasks(2, seed=5)
    reference = task.metadata["reference"]
    with Scorer(sandbox=hostile_sandbox) as scorer:
        first = scorer.submit(task, reference)
        assert scorer.submit(task, reference) is first and scorer.cache_hits == 1
        assert first.result().status == "passed"
        assert scorer.submit(task, reference) is first  # after it finished too
        assert scorer.submit(task, "None\n") is not first  # another program
        assert scorer.submit(other, reference) is not first  # another task
        loop = "next(x for x in iter(int, 1) if x)\n"  # spins forever in constant memory
        slow = scorer.submit(task, loop)
        assert slow.result().status == "timeout"
        assert scorer.submit(task, loop) is not slow  # a timeout may not repeat: run again
        assert scorer.cache_hits == 2


def test_lint_penalty_runs_ruff_in_the_sandbox(bwrap_sandbox):
    (task,) = synthetic_tasks(1, seed=0)
    with Scorer(RewardConfig(lint_penalty=0.5), sandbox=bwrap_sandbox) as scorer:
        clean = scorer.submit(task, task.metadata["reference"]).result()
        sloppy = scorer.submit(
            task, task.metadata["reference"] + "import os\n"
        ).result()
    assert clean.lint == () and clean.reward == 1.0
    assert sloppy.lint and sloppy.lint[0].startswith("F401") and sloppy.reward == 0.5


def test_batch_length_mismatch_is_an_error(bwrap_sandbox):
    with (
        Scorer(sandbox=bwrap_sandbox) as scorer,
        pytest.raises(ValueError, match="2 tasks but 1 completions"),
    ):
        scorer.score_batch(synthetic_tasks(2), ["x"])


def test_unusable_completion_scores_as_failed_not_an_exception(bwrap_sandbox, tmp_path):
    from rollouts.tasks import load_repo_task

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    task = load_repo_task(tmp_path, ["pytest", "tests"])
    with Scorer(sandbox=bwrap_sandbox) as scorer:
        reward = scorer.submit(task, "not json").result()
    assert (reward.status, reward.reward) == ("failed", 0.0)
    assert "completion is not JSON" in reward.result.message
