"""pass@k of a policy on held-out tasks: during training, and `jaxagent eval`. Single
completions (`evaluate`), or tool episodes for agent configs (`evaluate_agent`)."""

from __future__ import annotations

import dataclasses
from contextlib import closing
from pathlib import Path

import jax
from flax import nnx
from rich.progress import Progress

from jaxagent.checkpoint import CheckpointError, Checkpointer
from jaxagent.config import Config, load_config
from jaxagent.errors import UserError
from jaxagent.eval import mean_pass_at_k
from jaxagent.models.adapters import merged, save_policy, split_trainable
from jaxagent.steps import merged_model
from jaxagent.tokenizer import HFTokenizer
from jaxagent.train.build import (base_checkpoint, load_agent_splits, load_model_and_tokenizer,
                                  load_task_splits, make_progress, make_sampler, make_scorer,
                                  sampling_layout, tool_env_factory)
from rollouts.agent.metrics import agent_metrics
from rollouts.agent.rollout import run_episodes
from rollouts.environment import Trajectory
from rollouts.producer import Rollout, sample_and_score
from rollouts.rewards import Scorer
from rollouts.sampler import Sampler, continuation
from rollouts.tasks import Task, load_tasks
from sharding.distributed import gather, initialize, process_share
from sharding.layout import Layout


def evaluate(sampler: Sampler, tokenizer, scorer: Scorer, tasks: list[Task], *, samples: int,
             ks, temperature: float, max_new_tokens: int, seed: int, spread: bool = False):
    """({"eval/pass@k": ...}, rollouts): the unbiased pass@k estimator over `tasks` with
    `samples` completions each. `spread`: the sampler's weights span every process, so every
    process samples the whole batch (one SPMD program); each grades its share of the tasks
    (`process_share`) and all get every rollout, in task order."""
    graded = None
    if spread:
        share = process_share(len(tasks), jax.process_index(), jax.process_count())
        graded = range(share.start * samples, share.stop * samples)
    rollouts, _ = sample_and_score(sampler, tokenizer, scorer, tasks, num_samples=samples,
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   seed=seed, graded=graded)
    if spread:
        rollouts = [Rollout(**r) for r in gather([r.to_json() for r in rollouts])]
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


def solved(traj: Trajectory) -> bool:
    """An episode counts for pass@k when its final files pass the task's tests, whether it
    finished or ran out of budget (`eval/agent/truncated` says how often), and it left the
    tests alone."""
    return bool(traj.info.get("passed")) and not traj.info.get("hack")


def evaluate_agent(cfg: Config, sampler: Sampler, tokenizer, scorer: Scorer, tasks: list[Task],
                   *, samples: int, ks, temperature: float, seed: int,
                   progress: Progress | None = None) -> tuple[dict, list[Trajectory]]:
    """({"eval/pass@k": ..., "eval/agent/...": ...}, trajectories): `samples` episodes per
    task as `cfg.agent` configures them (budgets, tools, call format), `agent.episodes` in
    flight. pass@k is the unbiased estimator over each task's episodes (`solved`); the
    agent/... metrics are `agent_metrics` over all episodes (turns, calls per tool, bad calls,
    truncation, test-edit attempts, the share of solved episodes that ran the tests before
    finishing), with the tool mix as shares of all calls. `progress`: a bar that advances as
    episodes end."""
    episodes = [t for t in tasks for _ in range(samples)]
    if not episodes:
        return {}, []
    make_env = tool_env_factory(cfg, tokenizer, scorer)
    envs = [make_env() for _ in range(min(cfg.agent.episodes, len(episodes)))]
    cont = continuation(sampler, len(envs), max_new_tokens=cfg.agent.max_action_tokens,
                        temperature=temperature, top_k=cfg.sampler.top_k, top_p=cfg.sampler.top_p,
                        stop_token_ids=tokenizer.stop_ids, seed=seed)
    bar = progress.add_task("eval", total=len(episodes), info="") if progress else None
    try:
        trajs = run_episodes(cont, envs, episodes, on_done=None if bar is None else (
            lambda _: progress.update(bar, advance=1)))
    finally:
        for env in envs:
            env.close()
        if bar is not None:
            progress.remove_task(bar)
    scores = mean_pass_at_k([(t.task_id, solved(t)) for t in trajs],
                            [k for k in ks if k <= samples])
    out = {f"eval/pass@{k}": v for k, v in scores.items()}
    metrics = agent_metrics(trajs, episodes)
    out.update({f"eval/{k}": v for k, v in metrics.items()})
    calls = metrics["agent/tool_calls"]
    out.update({f"eval/agent/tool_share/{k.rsplit('/', 1)[1]}": v / calls
                for k, v in metrics.items() if k.startswith("agent/tool_calls/") and calls})
    return out, trajs


def agent_held_out(cfg: Config, sampler: Sampler, tokenizer, scorer: Scorer,
                   tasks: list[Task], progress: Progress | None = None) -> dict:
    """`evaluate_agent`'s scores as `cfg.eval` sets it (an agent training run's evaluation)."""
    scores, _ = evaluate_agent(cfg, sampler, tokenizer, scorer, tasks, samples=cfg.eval.samples,
                               ks=cfg.eval.k, temperature=cfg.eval.temperature,
                               seed=cfg.seed + 7, progress=progress)
    return scores


def episode_row(traj: Trajectory, tokenizer) -> dict:
    """One evaluated episode as `jaxagent eval --out` writes it."""
    info = traj.info
    return {"task_id": traj.task_id, "reward": traj.reward, "status": info.get("status"),
            "solved": solved(traj), "turns": info.get("turns"),
            "call_order": info.get("call_order", []), "truncated": info.get("truncated"),
            "text": tokenizer.decode(traj.tokens[traj.prompt_len:])}


def load_policy(cfg: Config, checkpoint: str | None, layout: Layout, overrides=()):
    """(model, tokenizer, cfg) from an HF directory, a run's workdir (its newest orbax
    checkpoint, with the run's own config and the command line's `overrides` on top) or, with
    no checkpoint, the config's model; every
    weight made on the sampler's mesh of `layout` (`sampling_layout`), as the RL loop loads
    onto the trainer's."""
    path = Path(checkpoint) if checkpoint else None
    if path is not None and (path / "checkpoints").is_dir():
        # the run's own workdir wherever it now lies (a learnt tokenizer is read from it)
        run_cfg = dataclasses.replace(load_config(path / "config.yaml", overrides),
                                      workdir=str(path))
        model, tokenizer = load_model_and_tokenizer(run_cfg, layout=layout, sampling=True)
        graphdef, weights = nnx.split(model)
        params, frozen = split_trainable(weights)  # with LoRA the run saved its adapters
        with closing(Checkpointer(path / "checkpoints")) as ckpt:
            # the policy alone (no optimizer state, no KL reference), onto the loaded params'
            # layout; evaluating changes nothing
            resumed = ckpt.restore_newest({"params": params}, set_aside=False, partial=True)
        if resumed is None:
            raise CheckpointError(f"{path / 'checkpoints'}: no complete checkpoint")
        state = resumed[1]
        return merged_model(graphdef, state["params"], frozen), tokenizer, run_cfg
    model, tokenizer = load_model_and_tokenizer(cfg, checkpoint, layout, sampling=True)
    return model, tokenizer, cfg


def run_export(cfg: Config, checkpoint: str, out: str | Path, *, merge: bool = False,
               overrides=()) -> Path:
    """`jaxagent export`: the policy at `checkpoint` (see `load_policy`) as an HF checkpoint;
    with adapters as a PEFT directory over the base it was trained on, or with `merge` as a
    full HF checkpoint with the adapters merged in."""
    model, tokenizer, run_cfg = load_policy(cfg, checkpoint, sampling_layout(cfg), overrides)
    is_run = (Path(checkpoint) / "checkpoints").is_dir()
    base = base_checkpoint(run_cfg.init_from if is_run else checkpoint)
    out = save_policy(merged(model) if merge else model, out, base)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(out)
    return out


def run_eval(cfg: Config, *, checkpoint: str | None = None, tasks: str | None = None,
             ks=(1,), samples: int | None = None, overrides=()) -> tuple[dict, list[dict]]:
    """`jaxagent eval`: (pass@k scores, one row per rollout) of a checkpoint (see
    `load_policy`) on `tasks` (a task spec) or the config's held-out split. An agent config
    (`agent.enabled`) plays episodes instead (`evaluate_agent`: pass@k and the agent/...
    metrics, one row per episode).

    Across processes (`distributed`, as `launch/` starts them) the model is sharded over all
    their devices and every process returns every row (`evaluate(spread=True)`)."""
    initialize(cfg.distributed)
    spread = jax.process_count() > 1
    layout = sampling_layout(cfg)
    model, tokenizer, cfg = load_policy(cfg, checkpoint, layout, overrides)
    sampler = make_sampler(model, tokenizer, cfg, layout.sampler_activations)
    if cfg.agent.enabled:
        return _run_agent_eval(cfg, sampler, tokenizer, tasks, ks, samples)
    task_list = load_tasks(tasks) if tasks else load_task_splits(cfg)[1]
    samples = samples or max(cfg.eval.samples, max(ks))
    with make_scorer(cfg) as scorer:
        scores, rollouts = evaluate(sampler, tokenizer, scorer, task_list, samples=samples,
                                    ks=ks, temperature=cfg.eval.temperature,
                                    max_new_tokens=cfg.train.max_new_tokens, seed=cfg.seed + 7,
                                    spread=spread)
    rows = [{"task_id": r.task_id, "completion": r.text, "status": r.status,
             "reward": r.reward} for r in rollouts]
    return scores, rows


def _run_agent_eval(cfg: Config, sampler: Sampler, tokenizer, tasks: str | None, ks,
                    samples: int | None) -> tuple[dict, list[dict]]:
    if jax.process_count() > 1:
        # one global batch per turn needs the same prompts everywhere, and the tools' outputs
        # (test timings, sandbox errors) may differ between processes
        raise UserError("eval: agent episodes (agent.enabled) run in one process; run "
                        "`jaxagent eval` without launch/ (on one host's devices)")
    task_list = load_tasks(tasks) if tasks else load_agent_splits(cfg)[1]
    if not task_list:
        raise UserError(f"agent.tasks {cfg.agent.tasks} has no held-out split (a directory of "
                        "deletion tasks is all training tasks): name the tasks to play with "
                        "--tasks DIR, or use agent.tasks=embedded:N[:SEED]")
    if any(t.repo is None for t in task_list):
        raise UserError(f"--tasks {tasks}: agent episodes need repository tasks")
    samples = samples or max(cfg.eval.samples, max(ks))
    # episodes take minutes: a line per finished episode, also when stderr is a file
    with make_scorer(cfg) as scorer, make_progress() as progress:
        scores, trajs = evaluate_agent(cfg, sampler, tokenizer, scorer, task_list,
                                       samples=samples, ks=ks, temperature=cfg.eval.temperature,
                                       seed=cfg.seed + 7, progress=progress)
    return scores, [episode_row(t, tokenizer) for t in trajs]
