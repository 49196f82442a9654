import json

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxagent.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = ["def add(a, b):\n    return a + b\n", "print('hello world')", "for i in range(10): pass"] * 20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>", "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "déf f(x):\n\treturn x ** 2  # ✓"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id and max(ids[1:]) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id], skip_special=False).endswith("✓<eos>")
    assert tok.stop_ids == (tok.eos_id,)
    assert load_tokenizer(None).vocab_size == 259


def test_hf_tokenizer_matches_transformers(hf_dir):
    ours = HFTokenizer(hf_dir)
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for text in ["def add(a, b):\n    return a + b", "unseen wörds ✓", ""]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.eos_id == ref.eos_token_id and ours.pad_id == ref.pad_token_id
    assert ours.stop_ids == (ours.eos_id, 0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2+2"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_hf_tokenizer_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json: not found"):
        HFTokenizer(tmp_path)


def test_sft_export_keeps_the_tokenizer(hf_dir, tmp_path):
    """train -> export -> reload: the same token ids, stop ids and chat template."""
    from jaxagent.cli import main
    from jaxagent.config import ModelConfig, load_config
    from jaxagent.models import init_model, save_pretrained
    from jaxagent.train.build import load_model_and_tokenizer

    source = tmp_path / "source"
    save_pretrained(init_model(ModelConfig(vocab_size=300, num_layers=1, hidden_size=32,
                                           intermediate_size=48, head_dim=8)), source)
    HFTokenizer(hf_dir).save(source)
    assert main(["sft", f"init_from={source}", "sft.steps=1", "sft.batch_size=8",
                 "tasks.num_train=20", "tasks.num_eval=2", f"workdir={tmp_path / 'run'}"]) == 0
    out = tmp_path / "run" / "sft"
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    _, tok = load_model_and_tokenizer(load_config(None, [f"init_from={out}"]))
    before = HFTokenizer(source)
    text = "def add(a, b):\n    return a + b  <|im_end|>"
    assert isinstance(tok, HFTokenizer) and tok.encode(text) == before.encode(text)
    assert tok.stop_ids == before.stop_ids == (before.eos_id, 0)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == before.apply_chat_template(messages)
