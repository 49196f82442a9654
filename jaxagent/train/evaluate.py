"""pass@k of a policy on held-out tasks: during training, and `jaxagent eval`."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

from flax import nnx

from jaxagent.checkpoint import CheckpointError, Checkpointer
from jaxagent.config import Config, load_config
from jaxagent.eval import mean_pass_at_k
from jaxagent.optim import make_optimizer
from jaxagent.train.build import (load_model_and_tokenizer, load_task_splits, make_sampler,
                                  make_scorer)
from rollouts.producer import sample_and_score
from rollouts.rewards import Scorer
from rollouts.sampler import Sampler
from rollouts.tasks import Task, load_tasks


def evaluate(sampler: Sampler, tokenizer, scorer: Scorer, tasks: list[Task], *, samples: int,
             ks, temperature: float, max_new_tokens: int, seed: int):
    """({"eval/pass@k": ...}, rollouts): the unbiased pass@k estimator over `tasks` with
    `samples` completions each."""
    rollouts, _ = sample_and_score(sampler, tokenizer, scorer, tasks, num_samples=samples,
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   seed=seed)
    scores = mean_pass_at_k([(r.task_id, r.status == "passed") for r in rollouts],
                            [k for k in ks if k <= samples])
    return {f"eval/pass@{k}": v for k, v in scores.items()}, rollouts


def held_out_pass_at_k(cfg: Config, sampler: Sampler, tokenizer, scorer: Scorer,
                       tasks: list[Task]) -> dict:
    """{"eval/pass@k": ...} of the sampler's weights as `cfg.eval` sets it (a training run's
    evaluation)."""
    scores, _ = evaluate(sampler, tokenizer, scorer, tasks, samples=cfg.eval.samples,
                         ks=cfg.eval.k, temperature=cfg.eval.temperature,
                         max_new_tokens=cfg.train.max_new_tokens, seed=cfg.seed + 7)
    return scores


def load_policy(cfg: Config, checkpoint: str | None):
    """(model, tokenizer, cfg) from an HF directory, a run's workdir (its newest orbax
    checkpoint, with the run's own config) or, with no checkpoint, the config's model."""
    path = Path(checkpoint) if checkpoint else None
    if path is not None and (path / "checkpoints").is_dir():
        run_cfg = load_config(path / "config.yaml")
        model, tokenizer = load_model_and_tokenizer(run_cfg)
        graphdef, params = nnx.split(model)
        tx = make_optimizer(run_cfg.optim, run_cfg.train.steps)
        like = {"params": params, "opt_state": tx.init(params),
                **({"ref_params": params} if run_cfg.rl.kl_coef else {})}  # as the run saved
        with closing(Checkpointer(path / "checkpoints")) as ckpt:
            resumed = ckpt.restore_newest(like, set_aside=False)  # evaluating changes nothing
        if resumed is None:
            raise CheckpointError(f"{path / 'checkpoints'}: no complete checkpoint")
        state = resumed[1]
        return nnx.merge(graphdef, state["params"]), tokenizer, run_cfg
    model, tokenizer = load_model_and_tokenizer(cfg, checkpoint)
    return model, tokenizer, cfg


def run_eval(cfg: Config, *, checkpoint: str | None = None, tasks: str | None = None,
             ks=(1,), samples: int | None = None) -> tuple[dict, list[dict]]:
    """`jaxagent eval`: (pass@k scores, one row per rollout) of a checkpoint (see
    `load_policy`) on `tasks` (a task spec) or the config's held-out split."""
    model, tokenizer, cfg = load_policy(cfg, checkpoint)
    task_list = load_tasks(tasks) if tasks else load_task_splits(cfg)[1]
    samples = samples or max(cfg.eval.samples, max(ks))
    sampler = make_sampler(model, tokenizer, cfg)
    with make_scorer(cfg) as scorer:
        scores, rollouts = evaluate(sampler, tokenizer, scorer, task_list, samples=samples,
                                    ks=ks, temperature=cfg.eval.temperature,
                                    max_new_tokens=cfg.train.max_new_tokens, seed=cfg.seed + 7)
    rows = [{"task_id": r.task_id, "completion": r.text, "status": r.status,
             "reward": r.reward} for r in rollouts]
    return scores, rows
