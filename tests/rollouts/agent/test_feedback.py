"""Flagged turns and teacher contexts for targeted feedback, aligned token for token."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from jaxagent.rl.feedback import feedback_loss, token_kl
from jaxagent.tokenizer import ByteTokenizer
from rollouts.agent.feedback import (
    HINTS,
    action_spans,
    feedback_examples,
    flagged_turns,
)
from rollouts.environment import Trajectory

TOK = ByteTokenizer()


def trajectory(flags):
    traj = Trajectory.start("t", [1, 2, 3, 4], version=0)
    for turn in range(len(flags)):
        traj.add_action([10 + turn, 20 + turn, 30 + turn], [-1.0] * 3)
        traj.add_observation([5] * (turn + 2))
    traj.info["turn_flags"] = flags
    return traj


FLAGS = [{"bad_tool_call": False, "test_edit": False, "repeat": False},
         {"bad_tool_call": True, "test_edit": False, "repeat": False},
         {"bad_tool_call": False, "test_edit": True, "repeat": True}]


def test_flagged_turns_and_alignment():
    traj = trajectory(FLAGS)
    assert action_spans(traj.policy_mask) == [(4, 7), (9, 12), (15, 18)]
    assert flagged_turns(traj, ["bad_tool_call", "test_edit", "repeat"]) == [
        (9, 12, "bad_tool_call"), (15, 18, "test_edit")]
    assert flagged_turns(traj, ["repeat"]) == [(15, 18, "repeat")]
    examples = feedback_examples(traj, TOK, ["bad_tool_call", "test_edit"])
    assert [e.detector for e in examples] == ["bad_tool_call", "test_edit"]
    for ex, (start, end) in zip(examples, [(9, 12), (15, 18)], strict=True):
        hint = TOK.encode("\n" + HINTS[ex.detector] + "\n")
        assert ex.teacher_tokens == traj.tokens[:start] + hint + traj.tokens[start:end]
        # logits at index i predict token i + 1, in both sequences
        np.testing.assert_array_equal(np.asarray(traj.tokens)[ex.student_index + 1], ex.targets)
        np.testing.assert_array_equal(np.asarray(ex.teacher_tokens)[ex.teacher_index + 1], ex.targets)
    assert feedback_examples(trajectory(FLAGS[:1]), TOK, list(HINTS)) == []
    with pytest.raises(ValueError, match="unknown feedback detector"):
        flagged_turns(traj, ["rudeness"])
    # after scripted calls (in the prompt), the flags of the sampled turns follow theirs
    started = trajectory(FLAGS)
    started.info.update(turn_flags=[FLAGS[1], FLAGS[2]] + FLAGS, prefix_calls=2)
    assert flagged_turns(started, ["repeat"]) == [(15, 18, "repeat")]
    traj.info["turn_flags"] = FLAGS[:2]
    with pytest.raises(ValueError, match="3 turns but 2 turn flags"):
        flagged_turns(traj, ["repeat"])


def test_teacher_with_a_hint_differs_from_the_student_only_at_flagged_turns():
    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=24, intermediate_size=40,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=12)
    model = init_model(cfg, seed=2)
    traj = trajectory(FLAGS)
    [ex] = feedback_examples(traj, TOK, ["bad_tool_call"])
    # both sequences right-padded to one length (causal: padding is unseen), one compile
    n = len(ex.teacher_tokens)
    batch = jnp.asarray([traj.tokens + [0] * (n - len(traj.tokens)), ex.teacher_tokens])
    logits = nnx.jit(lambda m, x: m(x))(model, batch)
    student, teacher = logits[0, ex.student_index], logits[1, ex.teacher_index]
    mask = jnp.ones((1, len(ex.targets)))
    for m, flagged in ((mask, True), (0 * mask, False)):
        loss = float(feedback_loss(token_kl(teacher[None], student[None], m), m, beta=1.0))
        assert loss > 1e-6 if flagged else loss == 0.0
