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


@pytest.mark.parametrize("argv, message", [
    (["eval", "--k", "1,a"], "--k 1,a: expected comma-separated whole numbers"),
    (["eval", "--k", "0"], "--k 0: every k must be >= 1"),
    (["eval", "--k", "5", "--samples", "2"], "--samples 2: pass@5 needs at least 5 samples"),
    (["eval", "--k", "1,5", "--samples", "2"], "--samples 2: pass@5 needs at least 5 samples"),
    (["train", "--config", "{tmp}"], "{tmp}: is a directory, not a YAML config file"),
    (["train", "--config", "{tmp}/latin1.yaml"], "latin1.yaml: not UTF-8 text (byte 7)"),
    (["train", "tasks.source=jsonl", "tasks.path={tmp}/bad.jsonl", "workdir={tmp}/run"],
     "bad.jsonl:1: invalid JSON"),
])
def test_bad_arguments_are_one_line(argv, message, tmp_path, capsys):
    (tmp_path / "latin1.yaml").write_bytes(b"seed: \xe9\n")
    (tmp_path / "bad.jsonl").write_text("{broken\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(tmp_path)) in err and err.count("\n") == 1


def test_tasks_files_name_the_bad_line_and_empty_sets(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"task_id": "a", "prompt": "p", "entry_point": "f", "tests": ["assert 1"]}\n'
                      b'{"task_id": "\xff"}\n')
    assert main(["tasks", "list", "--tasks", str(tasks)]) == 2
    assert "tasks.jsonl:2: not UTF-8 (byte 14)" in capsys.readouterr().err
    tasks.write_text("\n")
    assert main(["tasks", "list", "--tasks", str(tasks)]) == 1
    assert f"{tasks}: no tasks" in capsys.readouterr().err


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    import jaxagent.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_tasks", interrupted)
    assert main(["tasks", "list"]) == 130
    assert capsys.readouterr().err == "jaxagent: tasks interrupted\n"
