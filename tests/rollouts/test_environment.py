import pytest

from rollouts.environment import Environment, StepResult, Trajectory


class Countdown(Environment):
    """Echoes the action back reversed until the action is [0]."""

    turns = 0

    def reset(self, task):
        self.turns = 0
        return [7, 8, 9]

    def step(self, action):
        self.turns += 1
        done = list(action) == [0]
        return StepResult([] if done else list(action)[::-1], float(done), done,
                          {"turns": self.turns})


def test_trajectory_is_token_exact_and_masks_only_policy_tokens():
    env = Countdown()
    traj = Trajectory.start("t", env.reset(None), version=3)
    traj.add_action([1, 2], [-0.5, -0.25])
    traj.record(env.step([1, 2]))
    traj.add_action([0], [-1.0])
    traj.record(env.step([0]))
    tokens, mask, lps = traj.arrays()
    assert tokens.tolist() == [7, 8, 9, 1, 2, 2, 1, 0]
    assert mask.tolist() == [False] * 3 + [True, True, False, False, True]
    assert lps.tolist() == [0, 0, 0, -0.5, -0.25, 0, 0, -1.0]
    assert traj.done and traj.reward == 1.0 and traj.info == {"turns": 2}
    assert traj.prompt_len == 3 and traj.version == 3


def test_step_result_unpacks_as_the_tuple_the_interface_names():
    obs, reward, done, info = Countdown().step([0])
    assert (obs, reward, done, info) == ([], 1.0, True, {"turns": 1})


def test_action_and_logprob_lengths_must_match():
    traj = Trajectory.start("t", [1], version=0)
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        traj.add_action([1, 2], [0.0])
