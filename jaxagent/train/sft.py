"""Supervised fine-tuning: the warm-up before RL (`sft.steps`) and `jaxagent sft`."""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxagent.config import Config, ConfigError
from jaxagent.metrics import MetricsWriter, plot_curves
from jaxagent.models.adapters import save_policy, split_trainable
from jaxagent.models.lora import dropout_key
from jaxagent.optim import make_optimizer
from jaxagent.steps import (answer_accuracy, greedy_misses, merged_model, pack, pack_documents,
                            sampled_logprobs,
                            sft_step)
from jaxagent.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
from jaxagent.train.build import (
    base_checkpoint,
    demo_edit_tool,
    load_model_and_tokenizer,
    load_validation_tasks,
    logits_chunk,
    make_progress,
    make_scorer,
    resolve_attention,
    run_tasks,
    tokenizer_dir,
    tool_env_factory,
    validate,
)
from rollouts.agent.demos import (
    copy_rows,
    demonstrate,
    fact_tokens,
    path_copy_rows,
    recovery_calls,
    redraw_recovery,
    scripted_calls,
    substitute_trajectory,
    turn_weights,
    without_actions,
)
from rollouts.agent.feedback import action_spans
from rollouts.agent.formats import make_format
from rollouts.environment import Trajectory
from rollouts.tasks import Task
from rollouts.tasks.agent_family import redraw
from rollouts.tasks.documents import lookup_examples
from sharding.distributed import initialize, is_leader
from sharding.layout import Layout


def sft(cfg: Config, graphdef, params, tokenizer, tasks: list[Task], layout: Layout,
        progress=None, *, chunk: int = 0, frozen=None, log=None):
    """`cfg.sft.steps` of token-mean cross-entropy on `cfg.sft.data`: the tasks' reference
    completions, document-retrieval examples (then the metrics hold the held-out answer
    accuracy before and after), or agent demonstrations (after `sft.copy_steps` on copy rows;
    `sft/copy_loss` is the last of those; with `sft.valid_tasks`, the validation
    demonstrations' `sft/valid_exact/*` every `sft.valid_every` steps and at the end).
    `chunk`: tokens per LM-head chunk (`logits_chunk`). With LoRA, `params` are the adapters
    over the `frozen` base. `log(step, metrics)`, if given, hears each step's loss and each
    validation."""
    s = cfg.sft
    draw, eval_batch, copy_draw = _sft_data(cfg, tokenizer, tasks, progress)
    valid = (_agent_validation(cfg, graphdef, tokenizer, layout, progress, chunk, frozen)
             if s.valid_tasks else None)
    copy_steps = s.copy_steps if copy_draw is not None else 0
    # one optimizer (and learning-rate schedule) over the copy rows, then the demonstrations
    tx = make_optimizer(dataclasses.replace(cfg.optim, learning_rate=s.learning_rate),
                        copy_steps + s.steps)
    opt_state = layout.place(tx.init(params))
    rng = np.random.default_rng(cfg.seed)
    task_bar = (progress.add_task("sft", total=copy_steps + s.steps, info="")
                if progress else None)
    metrics, accuracy, copy_metrics, exact = {}, {}, {}, {}
    stages = [("copy", copy_draw, s.copy_batch_size, copy_steps, "sft.copy_batch_size"),
              ("", draw, s.batch_size, s.steps, "sft.batch_size")]
    with layout.activations():  # the programs below pin activations to the trainer's layout
        if eval_batch is not None:
            eval_batch = layout.batch(jax.tree.map(
                lambda x: x[layout.local_rows(s.documents.eval_examples)], eval_batch),
                "sft.documents.eval_examples")
            accuracy["sft/answer_accuracy_start"] = answer_accuracy(graphdef, params, eval_batch,
                                                                    chunk, frozen)
        step = 0  # across both stages: LoRA dropout's key
        for stage, stage_draw, rows, steps, key in stages:
            for _ in range(steps):
                # Every process draws the same global batch and keeps its own rows of it.
                mine = operator.itemgetter(layout.local_rows(rows))
                batch = layout.batch(jax.tree.map(mine, stage_draw(rng)), key)
                params, opt_state, metrics = sft_step(
                    graphdef, tx, params, opt_state, batch, cfg.train.micro_batch, chunk, frozen,
                    dropout_key(cfg.model.lora, cfg.seed, 0, step))
                step += 1
                row = {f"sft/{stage}_loss" if stage else "sft/loss": float(metrics["sft/loss"])}
                last = not stage and step == copy_steps + steps
                measured = valid is not None and not stage and (last or s.valid_every and (
                    step - copy_steps) % s.valid_every == 0)
                if measured:
                    exact = valid(params)
                    row.update(exact)
                if log:
                    log(step, row)
                if progress:
                    shown = (f" exact {exact['sft/valid_exact/episode']:.2f} sampled "
                             f"{exact['sft/valid_sampled/episode']:.2f}" if exact else "")
                    progress.update(task_bar, advance=1, info=f"{stage} loss "
                                    f"{float(metrics['sft/loss']):.3f}{shown}".lstrip())
                if measured and s.valid_stop and stop_share(exact, s.valid_stop_by) >= s.valid_stop:
                    break  # the copy the calls need has formed (see SFTConfig.valid_stop)
            if not stage and valid is not None:
                exact = {**exact, "sft/steps": step - copy_steps}
            if stage and steps:
                copy_metrics = {"sft/copy_loss": metrics["sft/loss"]}
        if eval_batch is not None:
            accuracy["sft/answer_accuracy"] = answer_accuracy(graphdef, params, eval_batch, chunk,
                                                              frozen)
    return params, {k: float(v) for k, v in
                    {**metrics, **copy_metrics, **accuracy, **exact}.items()}


def stop_share(exact: dict[str, float], by: str) -> float:
    """The validation's share `sft.valid_stop` reads (`sft.valid_stop_by`): of the exact
    demonstrations, the least of the templates' shares, or the sampled episodes' chance of
    replaying a demonstration."""
    if by == "episode":
        return exact["sft/valid_exact/episode"]
    if by == "sampled":
        return exact["sft/valid_sampled/episode"]
    return min(v for k, v in exact.items() if k.startswith("sft/valid_exact/episode/"))


@contextmanager
def warmup_log(workdir: str | Path):
    """log(step, metrics) into the warm-up's own `workdir/warmup` (metrics.jsonl, TensorBoard,
    then curves.png of the loss and the validation), on the SFT steps' axis: process 0's."""
    folder = Path(workdir) / "warmup"
    with closing(MetricsWriter(folder, enabled=is_leader())) as writer:
        yield writer.write
    if is_leader():
        plot_curves(folder / "metrics.jsonl", folder / "curves.png",
                    keys=("sft/loss", "sft/valid_exact/episode", "sft/valid_sampled/episode",
                          "sft/valid_exact/replace_line",
                          "sft/valid_exact/edit"))


def _agent_validation(cfg: Config, graphdef, tokenizer, layout: Layout, progress, chunk: int,
                      frozen):
    """valid(params) -> {"sft/valid_exact/<tool>": the share of the validation demonstrations'
    calls of that tool, "sft/valid_exact/episode": of whole demonstrations, whose every token
    is the greedy prediction given the demonstration before it; "sft/valid_sampled/episode":
    the mean chance that an episode sampled as the evaluation samples (eval.temperature,
    sampler.top_k / top_p) plays the demonstration's calls, each token drawn as written}. A
    copy the warm-up has not learnt (a path from an import line, a value from the test
    output) fails its call here; greedy decoding would replay an exact demonstration and pass.
    Both with "/<template>" per task template. Rows go `sft.batch_size` at a time (one
    compiled shape; the last group padded)."""
    tasks = load_validation_tasks(cfg)
    played = _agent_demonstrations(cfg, tokenizer, tasks, progress, recovery=False)
    batch, calls = validation_rows(played)
    batch = jax.tree.map(np.asarray, batch)  # on the host once: each validation slices it
    families = [t.metadata.get("family", "") for t in tasks]
    n, rows = len(played), cfg.sft.batch_size
    order = np.arange(-(-n // rows) * rows) % n  # repeats fill the last group

    sampling = (cfg.eval.temperature, cfg.sampler.top_k, cfg.sampler.top_p)

    def valid(params) -> dict[str, float]:
        misses, logps = [], []
        with layout.activations():
            for lo in range(0, len(order), rows):
                group = order[lo:lo + rows][layout.local_rows(rows)]
                part = layout.batch(jax.tree.map(lambda x: x[group], batch), "sft.batch_size")
                misses.append(np.asarray(layout.host_copy(
                    greedy_misses(graphdef, params, part, chunk, frozen))))
                logps.append(np.asarray(layout.host_copy(
                    sampled_logprobs(graphdef, params, part, sampling, chunk, frozen))))
        exact = call_exactness(np.concatenate(misses)[:n], calls, families)
        sampled = script_chance(np.concatenate(logps)[:n], calls, families)
        return {**{f"sft/valid_exact/{k}": v for k, v in exact.items()},
                **{f"sft/valid_sampled/{k}": v for k, v in sampled.items()}}

    return valid


def validation_rows(played: list[tuple[Trajectory, list, list[int]]]):
    """(one row per played demonstration, unweighted, one length; per row the [start, end)
    target positions and the tool of each call: position t predicts token t + 1)."""
    length = max(len(t.tokens) for t, _, _ in played) - 1
    batch = pack([t.tokens[:t.prompt_len] for t, _, _ in played],
                 [t.tokens[t.prompt_len:] for t, _, _ in played], bucket=length,
                 completion_masks=[t.policy_mask[t.prompt_len:] for t, _, _ in played])
    calls = [[(a - 1, b - 1, call.name) for (a, b), call in
              zip(action_spans(t.policy_mask), script, strict=True)] for t, script, _ in played]
    return batch, calls


def call_exactness(miss: np.ndarray, calls: list[list[tuple[int, int, str]]],
                   groups: list[str] | None = None) -> dict[str, float]:
    """{tool: the share of its calls with no greedy miss ([B, T] `miss`) in their span,
    "episode": the share of rows with none in any call, and "episode/<group>" the same over
    the rows of each of `groups` (a label per row: the task's template)}."""
    exact: dict[str, list[bool]] = {}
    for i, (row, spans) in enumerate(zip(miss, calls, strict=True)):
        right = [(tool, not row[a:b].any()) for a, b, tool in spans]
        for tool, ok in right:
            exact.setdefault(tool, []).append(ok)
        whole = all(ok for _, ok in right)
        exact.setdefault("episode", []).append(whole)
        if groups is not None:
            exact.setdefault(f"episode/{groups[i]}", []).append(whole)
    return {k: float(np.mean(v)) for k, v in sorted(exact.items())}


def script_chance(logp: np.ndarray, calls: list[list[tuple[int, int, str]]],
                  groups: list[str]) -> dict[str, float]:
    """{"episode": the mean over rows of exp(the [B, T] `logp` summed over every call's span):
    the chance that sampling plays the row's calls token for token, "episode/<group>" the same
    over the rows of each of `groups`}. Sampled episodes that follow the script see its tool
    outputs, so this is the share of sampled episodes that replay it."""
    chance = np.exp([sum(row[a:b].sum() for a, b, _ in spans) for row, spans in
                     zip(logp.astype(np.float64), calls, strict=True)])
    out = {"episode": float(chance.mean())}
    for group in sorted(set(groups)):
        out[f"episode/{group}"] = float(chance[[g == group for g in groups]].mean())
    return out


def _sft_data(cfg: Config, tokenizer, tasks: list[Task], progress=None):
    """(draw(rng) -> a packed batch of `sft.batch_size` rows, held-out batch or None,
    copy_draw(rng) -> a packed batch of `sft.copy_batch_size` copy rows, or None)."""
    s = cfg.sft
    encode = functools.partial(tokenizer.encode, add_bos=False)
    stop = list(tokenizer.stop_ids[:1])
    if s.data == "agent":
        played = _agent_demonstrations(cfg, tokenizer, tasks, progress)
        demos = [traj for traj, _, _ in played]
        # One padded length for every draw (the longest demonstration, with room for redrawn
        # facts' longer names): one compiled step.
        length = max(len(t.tokens) for t in demos) - 1 + (32 if s.redraw_facts else 0)

        def demo(i, rng):
            """A demonstration (facts drawn afresh) and its loss weights over every token but
            the first: each turn weighs 1 (a recovery's wrong edits 0), each token spelling a
            fact `sft.fact_weight` more, each prompt or tool output token
            `sft.observation_weight`."""
            (traj, _, wrong), mapping = played[i], {}
            if s.redraw_facts:
                draw_facts = redraw_recovery if wrong else redraw
                mapping = draw_facts(tasks[i], random.Random(int(rng.integers(2**63))))
                traj = substitute_trajectory(traj, mapping, tokenizer)
            acted = traj.policy_mask  # every action, a wrong edit too: not the environment's
            if wrong:  # after the substitution, which re-encodes each masked run as one text
                traj = dataclasses.replace(traj, policy_mask=without_actions(acted, wrong))
            weights = turn_weights(traj.policy_mask)
            if s.fact_weight:
                facts = fact_tokens(traj, mapping, tokenizer)
                weights = [w + s.fact_weight * f for w, f in zip(weights, facts)]
            if s.observation_weight:
                weights = [w if m else s.observation_weight for w, m in zip(weights, acted)]
            return traj, weights[1:]

        def draw(rng):
            rows = [demo(i, rng) for i in rng.integers(0, len(demos), s.batch_size)]
            # the first token (BOS) is never a target: the rest is weighed by `demo`
            return pack([t.tokens[:1] for t, _ in rows], [t.tokens[1:] for t, _ in rows],
                        bucket=length, completion_masks=[w for _, w in rows])

        if not s.copy_steps:
            return draw, None, None
        render = make_format(cfg.agent.call_format).render_call
        if s.copy_data == "paths":  # made up, as many as the steps draw
            made = random.Random(f"path-copy/{cfg.seed}")
            copies = path_copy_rows(made, s.copy_steps * s.copy_batch_size, tokenizer, render)
        else:
            # not from a recovery: its fix edits a file no read showed
            copies = [row for traj, calls, wrong in played if not wrong
                      for row in copy_rows(traj, calls, tokenizer, render)]
        if not copies:
            raise ConfigError("sft.copy_steps: the demonstrations hold no read_file or edit "
                              "call to copy from (recovery ones give none: see sft.recovery)")

        def copy_draw(rng):
            rows = [copies[i] for i in rng.integers(0, len(copies), s.copy_batch_size)]
            # rows of 100-700 tokens, rounded to 128: a few compiled shapes, little padding
            return pack([c for c, _, _ in rows], [a for _, a, _ in rows], bucket=128,
                        completion_masks=[w for _, _, w in rows])

        return draw, None, copy_draw
    if s.data == "documents":
        d = s.documents

        def examples(n, seed):
            return pack_documents(
                [([encode(doc) for doc in e.documents], encode(e.question), encode(e.answer) + stop)
                 for e in lookup_examples(n, num_documents=d.num_documents, entries=d.entries,
                                          seed=seed)], cfg.model.documents)

        # Training seeds come from the step's rng; the held-out set from a seed it never draws.
        return (lambda rng: examples(s.batch_size, int(rng.integers(1, 2**31))),
                examples(d.eval_examples, 0), None)
    data = [(tokenizer.encode(t.prompt, add_bos=tokenizer.add_bos),
             encode(t.metadata["reference"]) + stop)
            for t in tasks if "reference" in t.metadata]
    if not data:
        raise ValueError("sft.steps > 0 but no task has metadata['reference'] to imitate")

    def draw(rng):
        rows = [data[i] for i in rng.integers(0, len(data), s.batch_size)]
        return pack([p for p, _ in rows], [c for _, c in rows])

    return draw, None, None


def _agent_demonstrations(cfg: Config, tokenizer, tasks: list[Task], progress=None, *,
                          recovery: bool = True):
    """(trajectory, scripted calls, positions of the wrong calls): one scripted, graded episode
    per task through the configured environment (one a thread, its sandbox renewed for each
    task; turn budget raised to fit the ordinary script), `rewards.workers` at a time; a
    demonstration that fails or is cut is a config error. With `recovery`, `sft.recovery` of
    them (`recovers`) play `recovery_calls`, which must fit `agent.max_turns`."""
    edit_tool = demo_edit_tool(cfg)
    scripts = [recovery_calls(task, edit_tool) if recover and recovery
               else (scripted_calls(task, edit_tool), [])
               for task, recover in zip(tasks, recovers(cfg, tasks))]
    longest = max((len(calls) for calls, wrong in scripts if wrong), default=0)
    if longest > cfg.agent.max_turns:
        raise ConfigError(f"sft.recovery: a recovery demonstration takes {longest} calls but "
                          f"agent.max_turns is {cfg.agent.max_turns}; raise agent.max_turns "
                          "or set sft.recovery: 0")
    with make_scorer(cfg) as scorer:
        make_env = tool_env_factory(cfg, tokenizer, scorer, max_turns=max(
            cfg.agent.max_turns, *(len(c) for c, _ in scripts)))
        bar = progress.add_task("demos", total=len(tasks), info="") if progress else None
        local, envs = threading.local(), []  # an environment a thread, its sandbox renewed

        def play(task: Task, script) -> tuple[Trajectory, list, list[int]]:
            if not hasattr(local, "env"):
                local.env = make_env()
                envs.append(local.env)
            traj = demonstrate(local.env, task, script[0])
            if traj.info.get("truncated"):
                raise ConfigError(f"sft.data: the agent demonstration of {task.id} was cut by "
                                  f"{traj.info['truncated_by']}; raise agent.max_context_tokens")
            if not traj.info.get("passed"):
                raise ConfigError(f"sft.data: the agent demonstration of {task.id} did not pass "
                                  f"(status {traj.info.get('status')!r})")
            if progress:
                progress.update(bar, advance=1)
            return traj, *script

        try:
            with ThreadPoolExecutor(max(1, cfg.rewards.workers)) as pool:
                return list(pool.map(play, tasks, scripts))
        finally:
            for env in envs:
                env.close()


# training tasks whose texts the run's BPE learns from: ~100k bytes of demonstrations, past which
# the merges a vocabulary of ~1k ids holds no longer change much
TOKENIZER_CORPUS = 64


def fit_tokenizer(cfg: Config, tasks: list[Task], progress=None, report=print) -> None:
    """With `model.tokenizer: bpe` at random init, learn the run's tokenizer (`train_bpe` of
    `model.vocab_size` ids) from the first `TOKENIZER_CORPUS` training tasks' texts (with
    `sft.data: agent` their scripted demonstrations played in bytes, else each prompt and
    reference) into `tokenizer_dir`, unless this workdir holds one already (a resumed run keeps
    its ids). Process 0 learns it, and `report`s its size and bytes a token on its corpus; the
    others wait for it."""
    folder = tokenizer_dir(cfg)
    if cfg.model.tokenizer != "bpe" or cfg.init_from is not None:
        return
    if is_leader() and not (folder / "tokenizer.json").exists():
        corpus = tasks[:TOKENIZER_CORPUS]
        if cfg.sft.data == "agent":
            raw = ByteTokenizer()
            texts = [raw.decode(t.tokens) for t, _, _ in
                     _agent_demonstrations(cfg, raw, corpus, progress, recovery=False)]
        else:
            texts = [t.prompt + t.metadata.get("reference", "") for t in corpus]
        partial = folder.with_name(folder.name + ".partial")  # a kill leaves no half tokenizer
        bpe = train_bpe(texts, cfg.model.vocab_size, partial)
        partial.replace(folder)
        ratio = sum(len(x.encode()) for x in texts) / sum(len(bpe.encode(x)) for x in texts)
        report(f"model.tokenizer: a BPE of {bpe.vocab_size} ids from {len(texts)} texts "
               f"({ratio:.2f} bytes a token on them) -> {folder}")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("tokenizer learnt")


def recovers(cfg: Config, tasks: list[Task]) -> list[bool]:
    """Which tasks' demonstrations play a wrong first attempt (`sft.recovery` of them): each
    drawn from the run's seed and the task's id, so a resumed or replayed run draws the same,
    and a share of 0 draws none."""
    return [random.Random(f"sft-recovery/{cfg.seed}/{task.id}").random() < cfg.sft.recovery
            for task in tasks]


def run_sft(cfg: Config) -> Path:
    """SFT on the training tasks' references (an agent config: scripted episodes over its
    repository tasks); writes an HF checkpoint to `workdir/sft` (with LoRA, a PEFT adapter
    directory: `save_policy`)."""
    if cfg.sft.steps <= 0:
        raise ValueError("sft.steps: must be > 0 for `jaxagent sft`")
    cfg = validate(cfg)
    initialize(cfg.distributed)
    cfg = resolve_attention(cfg)  # asks JAX for the platform: after jax.distributed starts
    layout = Layout(cfg.mesh, cfg.sampler.mesh)
    layout.check_batch(cfg.sft.batch_size, "sft.batch_size")
    if cfg.sft.copy_steps:
        layout.check_batch(cfg.sft.copy_batch_size, "sft.copy_batch_size")
    train_tasks, _ = run_tasks(cfg)  # an agent config's repository tasks, or single ones
    with make_progress() as progress, warmup_log(cfg.workdir) as log:
        fit_tokenizer(cfg, train_tasks, progress)
        model, tokenizer = load_model_and_tokenizer(cfg, layout=layout)
        graphdef, weights = layout.split(model)
        params, frozen = split_trainable(weights)
        params, metrics = sft(cfg, graphdef, params, tokenizer, train_tasks, layout, progress,
                              chunk=logits_chunk(cfg, model), frozen=frozen, log=log)
    # every process joins (one array at a time, into host memory); only process 0 writes
    params, frozen = layout.host_copy(params), layout.host_copy(frozen)
    out = Path(cfg.workdir) / "sft"
    if is_leader():
        save_policy(merged_model(graphdef, params, frozen), out, base_checkpoint(cfg.init_from))
        if isinstance(tokenizer, HFTokenizer):  # reloads tokenize, stop and chat as before
            tokenizer.save(out)
        (out / "sft_metrics.json").write_text(json.dumps(metrics))
    if jax.process_count() > 1:  # the others return the directory process 0 is writing
        multihost_utils.sync_global_devices("sft checkpoint written")
    return out
