"""Run under launch/local_multihost.sh with a tasks file: `jaxagent eval`'s path
(`run_eval`: the model sharded over both processes' devices, one global batch, each process
grading its share of the tasks) against every process sampling and grading all the tasks
alone on its own devices, same weights and seed; prints the scores when the rows agree."""

import json
import sys

import jax

from jaxagent.config import load_config
from jaxagent.train.build import load_model_and_tokenizer, make_sampler, make_scorer
from jaxagent.train.evaluate import evaluate, run_eval
from rollouts.tasks import load_tasks
from sharding.layout import Layout

tasks_path, overrides = sys.argv[1], sys.argv[2:]
cfg = load_config(None, overrides)
scores, rows = run_eval(cfg, tasks=tasks_path, ks=(1, 2), samples=3)
assert jax.process_count() == 2 and len(jax.devices()) == 4

layout = Layout(cfg.mesh)  # training's: each process samples on its own 2 devices
assert len(layout.sampler_mesh.devices.flat) == 2
model, tokenizer = load_model_and_tokenizer(cfg, None, layout, sampling=True)
sampler = make_sampler(model, tokenizer, cfg, layout.sampler_activations)
with make_scorer(cfg) as scorer:
    alone, rollouts = evaluate(sampler, tokenizer, scorer, load_tasks(tasks_path), samples=3,
                               ks=(1, 2), temperature=cfg.eval.temperature,
                               max_new_tokens=cfg.train.max_new_tokens, seed=cfg.seed + 7)
expected = [{"task_id": r.task_id, "completion": r.text, "status": r.status,
             "reward": r.reward} for r in rollouts]
assert rows == expected, (rows, expected)
assert scores == alone, (scores, alone)
print(f"process {jax.process_index()}: {json.dumps(scores, sort_keys=True)}", flush=True)
