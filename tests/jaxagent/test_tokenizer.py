import json

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxagent.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = ["def add(a, b):\n    return a + b\n", "print('hello world')", "for i in range(10): pass"] * 20


def byte_level_bpe(specials: list[str]) -> Tokenizer:
    """A byte-level BPE of 300 ids trained on CORPUS, GPT-2/Qwen/Llama-3 style."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = byte_level_bpe(specials)
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


# Llama-3: BOS comes from tokenizer.json's post-processor (tokenizer_config.json has no
# add_bos_token) and again from the chat template's `{{ bos_token }}`.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """A tiny Llama-3 style tokenizer beside a tiny model."""
    from jaxagent.models import init_model, save_pretrained
    from jaxagent.models.config import ModelConfig

    path = tmp_path_factory.mktemp("llama3")
    tok = byte_level_bpe(LLAMA3_SPECIALS)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": bos, "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    save_pretrained(init_model(ModelConfig(vocab_size=300, num_layers=1, hidden_size=32,
                                           intermediate_size=48, head_dim=8)), path)
    return path


def test_llama3_raw_prompts_start_with_bos_once_as_transformers(llama3_dir):
    ours = HFTokenizer(llama3_dir)
    ref = transformers.AutoTokenizer.from_pretrained(llama3_dir)
    assert ours.add_bos and ours.bos_id == ref.bos_token_id
    for text in ["def add(a, b):\n    return a + b", "unseen wörds ✓", ""]:
        ids = ours.encode(text, add_bos=ours.add_bos)
        assert ids == ref.encode(text) and ids.count(ours.bos_id) == 1
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)


def test_llama3_chat_prompt_keeps_the_templates_bos_only(llama3_dir):
    ours = HFTokenizer(llama3_dir)
    ref = transformers.AutoTokenizer.from_pretrained(llama3_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2+2"}]
    text = ours.apply_chat_template(messages)
    assert text.startswith("<|begin_of_text|>")
    ids = ours.encode(text, add_bos=ours.add_bos)
    expected = ref(ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]  # how transformers tokenizes a chat
    assert ids == expected and ids.count(ours.bos_id) == 1 and ids[0] == ours.bos_id


def test_llama3_task_and_agent_prompts_start_with_bos_once(llama3_dir):
    """The loaded checkpoint's tokenizer through the paths that encode prompts: a task's raw
    prompt (training and held-out eval) and the agent formats' chat prompts."""
    from jaxagent.config import load_config
    from jaxagent.train.build import load_model_and_tokenizer
    from rollouts.agent.formats import FORMATS
    from rollouts.producer import CodeTaskEnv
    from rollouts.tasks import Task

    _, tok = load_model_and_tokenizer(load_config(None, [f"init_from={llama3_dir}"]))
    assert isinstance(tok, HFTokenizer) and tok.add_bos
    task = Task(id="t", prompt="def add(a, b):", entry_point="add", tests=())
    prompt = CodeTaskEnv(tok, scorer=None).reset(task)
    assert prompt[0] == tok.bos_id and prompt.count(tok.bos_id) == 1
    for name, fmt in FORMATS.items():
        text = fmt().prompt(tok, "add two numbers", [])
        ids = tok.encode(text, add_bos=tok.add_bos)  # as ToolEnvironment.reset encodes it
        assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1, name


def test_train_bpe_extends_the_byte_tokenizer(tmp_path):
    """Learnt merges on top of the byte tokenizer's ids: bytes 0..255 and the specials keep
    their ids (ModelConfig's defaults), any text round-trips, the chat format is the byte
    tokenizer's, and the corpus' words encode in fewer tokens than bytes."""
    rng = np.random.default_rng(7)
    words = ["@run_tests", "replace_line", "app/core.py", "AssertionError", "passed", "failed"]
    corpus = [" ".join(rng.choice(words, 40)) + f" {int(rng.integers(100))}\n" for _ in range(60)]
    tok = train_bpe(corpus, 333, tmp_path)
    byte = ByteTokenizer()
    assert 259 < tok.vocab_size <= 333
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (256, 257, 258, (257,))
    assert not tok.add_bos
    # a character the corpus never held is its UTF-8 bytes, with the byte tokenizer's ids
    assert all(tok.encode(chr(c)) == byte.encode(chr(c)) for c in range(0x800))
    text = "".join(chr(int(c)) for c in rng.integers(1, 0x3000, 500)) + " \n\t ☃ app/core.py"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text) + [tok.eos_id]) == text  # specials skipped
    held_out = " ".join(rng.choice(words, 200))
    assert len(tok.encode(held_out)) < len(held_out.encode()) / 4
    messages = [{"role": "system", "content": "tools:\nx"}, {"role": "user", "content": "fix"}]
    for generation in (True, False):
        assert tok.apply_chat_template(messages, add_generation_prompt=generation) == \
            byte.apply_chat_template(messages, add_generation_prompt=generation)
    with pytest.raises(ValueError, match="vocab_size 258: .* at least 259"):
        train_bpe(corpus, 258, tmp_path / "small")


def test_train_bpe_writes_a_name_as_one_token_wherever_it_stands(tmp_path):
    """A copy reads the name where the prompt, a file or pytest shows it and writes it after
    the edit's JSON quote: the learnt BPE must give it the same ids in each (GPT-2's
    pre-tokenizer gave `ĠLIMIT` after a space and `LIMIT` after the quote)."""
    rng = np.random.default_rng(3)
    names = ["LIMIT", "BONUS", "MARGIN", "OFFSET"]
    corpus = []
    for _ in range(80):
        name, value = rng.choice(names), int(rng.integers(10, 99))
        corpus.append(f"Fix {name} so the tests pass.\n    3  {name} = 7\nAssertionError: "
                      f"{name} should be {value}\n@replace_line {{\"line\": 3, \"text\": "
                      f"\"{name} = {value}\"}}\n    return x + {name}\n")
    tok = train_bpe(corpus, 400, tmp_path)
    for name in names:
        word = tok.encode(f"{name} ")
        assert len(word) == 1, (name, word)  # a learnt merge, not bytes
        for context in (f"Fix {name} so", f"    3  {name} = 7", f"\"text\": \"{name} = 42\"",
                        f"AssertionError: {name} should be 42"):
            ids = tok.encode(context)
            assert word[0] in ids, (context, [tok.decode([i]) for i in ids])
    value = tok.encode("42")
    for text in ("be 42\n", "= 42\"", "== 42,"):
        ids = tok.encode(text)
        assert any(ids[i:i + len(value)] == value for i in range(len(ids))), text
