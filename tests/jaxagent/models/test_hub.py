"""Hub ids (`org/name[@revision]`) resolve through the Hugging Face cache: a cache this test
builds, offline (no network here), as a user's HF_HOME would hold it."""

from __future__ import annotations

import os
import subprocess
import sys

from jaxagent.config import ModelConfig
from jaxagent.models import init_model, save_pretrained

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(home):
    repo = home / "hub" / "models--acme--tiny-coder"
    snapshot = repo / "snapshots" / COMMIT
    save_pretrained(init_model(ModelConfig(num_layers=1, hidden_size=32, intermediate_size=48,
                                           head_dim=8), seed=5), snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def _cli(home, *args):
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "XLA_FLAGS": ""}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "jaxagent.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_hub_ids_resolve_through_the_cache_and_a_missing_one_is_one_line(tmp_path):
    _cache(tmp_path)
    common = ["--prompt", "def f(", "--max-new-tokens", "3", "--temperature", "0"]
    by_name = _cli(tmp_path, "generate", "--model", "acme/tiny-coder", *common)
    assert by_name.returncode == 0, by_name.stderr[-2000:]
    pinned = _cli(tmp_path, "generate", "--model", f"acme/tiny-coder@{COMMIT}", *common)
    assert pinned.returncode == 0 and pinned.stdout == by_name.stdout
    missing = _cli(tmp_path, "generate", "--model", "acme/no-such-model", *common)
    assert missing.returncode == 2
    assert missing.stderr.startswith("jaxagent: error: acme/no-such-model: no such directory, "
                                     "and the Hugging Face hub gave no model")
    assert missing.stderr.count("\n") == 1
