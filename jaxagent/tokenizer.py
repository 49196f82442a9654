"""Tokenizers: HF `tokenizers` for real checkpoints, bytes for the tiny default model, and a
byte-level BPE trained on a run's own texts (`train_bpe`) for a tiny model that reads fewer tokens.

Both expose `encode`, `decode`, `bos_id`, `eos_id`, `pad_id`, `stop_ids`, `vocab_size` and
`apply_chat_template(messages)`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Protocol

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    vocab_size: int
    add_bos: bool  # whether a raw prompt starts with BOS (the model was trained so)

    # add_bos: start with BOS exactly once (text that already does, e.g. a chat template's
    # rendering, gets no second one)
    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids, *, skip_special: bool = True) -> str: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    # the bytes each id writes, None for a special token (the call grammar reads actions so)
    def token_bytes(self) -> list[bytes | None]: ...

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then BOS, EOS, PAD. Matches the tiny default model."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259
    add_bos = False  # the tiny default model is trained on raw bytes

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        if not skip_special and any(i >= 256 for i in ids):
            names = {self.bos_id: "<bos>", self.eos_id: "<eos>", self.pad_id: "<pad>"}
            parts, run = [], []
            for i in ids:
                if i < 256:
                    run.append(i)
                else:
                    parts += [bytes(run).decode("utf-8", "replace"), names.get(i, f"<{i}>")]
                    run = []
            return "".join(parts) + bytes(run).decode("utf-8", "replace")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def token_bytes(self) -> list[bytes | None]:
        """The bytes each id writes (None: a special token)."""
        return [bytes([i]) for i in range(256)] + [None] * (self.vocab_size - 256)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


# ByteTokenizer.apply_chat_template as Jinja (trim_blocks drops a newline after a tag, so the
# newlines that belong to the text are written as expressions)
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}"
                      "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                      "{{ '\\n' }}{% endif %}")


def _byte_symbols() -> list[str]:
    """The character byte-level BPE writes for each byte 0..255 (GPT-2's table: printable
    bytes as themselves, the rest shifted past 255)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


def _pre_tokenizer():
    """Words, numbers and runs of punctuation, each with the space after it (if one), then
    GPT-2's byte symbols. GPT-2's pre-tokenizer takes the space before a word: a name was
    `ĠBONUS` after a space (the prompt, the file, pytest's message) but `BONUS` after the
    edit's JSON quote, so a copy had to map one token to another; taking the space after makes
    it `BONUSĠ` in all four (docs/agent.md, thirty-third session), in ~8% fewer tokens."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\w+ ?|[^\s\w]+ ?|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_bpe(texts, vocab_size: int, directory: str | Path) -> HFTokenizer:
    """A byte-level BPE (merges stay inside a word, a number or a run of punctuation, each
    with the one space after it: `_pre_tokenizer`) of at most `vocab_size` ids laid out as the
    byte tokenizer's, then merges:
    ids 0..255 the bytes, 256 / 257 / 258 `<bos>` `<eos>` `<pad>` (`ModelConfig`'s defaults),
    then the merges learnt from `texts`. Written to `directory` (tokenizer.json,
    tokenizer_config.json with the byte tokenizer's chat format) and loaded from there. Any
    text encodes; BOS is not added, as with the byte tokenizer."""
    specials = ["<bos>", "<eos>", "<pad>"]
    if vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(f"vocab_size {vocab_size}: a byte-level BPE needs at least "
                         f"{ByteTokenizer.vocab_size} ids (256 bytes and 3 specials)")
    learnt = _HFTokenizer(models.BPE())
    learnt.pre_tokenizer = _pre_tokenizer()
    learnt.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    trained = json.loads(learnt.to_str())["model"]
    merged = sorted((i, t) for t, i in trained["vocab"].items() if len(t) > 1 and t not in specials)
    order = [*_byte_symbols(), *specials, *(t for _, t in merged)]
    bpe = _HFTokenizer(models.BPE({t: i for i, t in enumerate(order)},
                                  [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                                   for m in trained["merges"]]))
    bpe.add_special_tokens(specials)
    bpe.pre_tokenizer = _pre_tokenizer()
    bpe.decoder = decoders.ByteLevel()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "add_bos_token": False, "chat_template": BYTE_CHAT_TEMPLATE}, indent=1))
    return HFTokenizer(directory)


def _token_content(token) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts.
    return token.get("content") if isinstance(token, dict) else token


# What a model directory holds besides config and weights, that a reload needs to tokenize,
# stop and chat as before (copied as they are by `HFTokenizer.save`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


class HFTokenizer:
    """`tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json` when present)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file}: not found; the checkpoint has no fast tokenizer")
        self._tok = _HFTokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(path / "tokenizer_config.json")
        self.chat_template = config.get("chat_template")
        self._special = {name: _token_content(config.get(f"{name}_token"))
                         for name in ("bos", "eos", "pad")}
        self.bos_id = self._id(self._special["bos"])
        self.eos_id = self._id(self._special["eos"])
        pad = self._id(self._special["pad"])
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        # A Llama-3 style tokenizer.json adds BOS in its post-processor and its config has no
        # `add_bos_token`: either says the model was trained on prompts that start with BOS.
        self.add_bos = self.bos_id is not None and (
            bool(config.get("add_bos_token", False)) or self._post_processor_adds_bos())
        generation = _read_json(path / "generation_config.json").get("eos_token_id", [])
        extra = generation if isinstance(generation, list) else [generation]
        self._stop_ids = tuple(dict.fromkeys(
            [i for i in [self.eos_id, *extra] if i is not None]))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _post_processor_adds_bos(self) -> bool:
        special = self._tok.encode("a", add_special_tokens=True).ids
        plain = self._tok.encode("a", add_special_tokens=False).ids
        return special[:1] == [self.bos_id] and plain[:1] != [self.bos_id]

    def save(self, directory: str | Path) -> list[str]:
        """Copy this tokenizer's files (TOKENIZER_FILES present in its directory) into
        `directory`, beside an exported model; the names copied."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        copied = [name for name in TOKENIZER_FILES if (self.path / name).is_file()]
        for name in copied:
            (directory / name).write_bytes((self.path / name).read_bytes())
        return copied

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        # The post-processor's specials are never added here: BOS is ours to add, once.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def token_bytes(self) -> list[bytes | None]:
        """The bytes each id writes (None: an added or special token), for a byte-level BPE
        (GPT-2's, Llama 3's, Qwen's, `train_bpe`'s); a tokenizer whose pieces are not byte
        strings (SentencePiece's "▁" pieces) raises ValueError."""
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            raise ValueError(f"{self.path / 'tokenizer.json'}: not a byte-level BPE (decoder "
                             f"{type(self._tok.decoder).__name__}), so its ids have no byte "
                             "strings")
        byte_of = {ch: b for b, ch in enumerate(_byte_symbols())}
        added = {int(i) for i in self._tok.get_added_tokens_decoder()}
        pieces = [self._tok.id_to_token(i) for i in range(self.vocab_size)]
        return [None if i in added or piece is None else bytes(byte_of[ch] for ch in piece)
                for i, piece in enumerate(pieces)]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("tokenizer_config.json has no chat_template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._special["bos"] or "", eos_token=self._special["eos"] or "", **kwargs)


def render_chat_template(template: str, messages: list[dict], **variables) -> str:
    """Render a Jinja chat template the way `transformers` does (sandboxed, same options)."""
    return _compiled(template).render(messages=messages, **variables)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """The template compiled once (~3-6 ms a compile; an agent step renders one per tool call)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _read_json(file: Path) -> dict:
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from None


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The checkpoint's HF tokenizer, or the byte tokenizer when `path` is None."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
