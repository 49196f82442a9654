import subprocess
import sys

import pytest

from jaxagent.cli import main
from jaxagent.config import ModelConfig
from jaxagent.models import init_model, save_pretrained

SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=48",
         "model.head_dim=8", "sampler.prompt_bucket=16", "sampler.cache_bucket=16"]


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "jaxagent.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "generate" in out


def test_generate_with_default_tiny_model(capsys):
    assert main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "6",
                 "--temperature", "0", *SMALL]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "6",
                 "--temperature", "0", *SMALL]) == 0
    assert capsys.readouterr().out == first  # greedy: same completion twice
    assert first.endswith("\n")


def test_generate_from_checkpoint_directory(tmp_path, capsys):
    cfg = ModelConfig(num_layers=1, hidden_size=32, intermediate_size=48, head_dim=8)
    save_pretrained(init_model(cfg, seed=2), tmp_path / "ckpt")
    assert main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "x",
                 "--num-samples", "2", "--max-new-tokens", "5", *SMALL[4:]]) == 0
    assert capsys.readouterr().out.count("--- sample") == 2


@pytest.mark.parametrize("args, message", [
    (["model.num_layerz=2"], "model.num_layerz: unknown key"),
    (["--model", "/nonexistent"], "/nonexistent/config.json: not found"),
])
def test_bad_input_exits_2_naming_it(args, message, capsys):
    assert main(["generate", "--prompt", "x", *args]) == 2
    assert message in capsys.readouterr().err
