"""Text <-> token ids, chat prompts, and streaming detokenization.

The engine reads models from GGUF files, which carry no `tokenizer.json`: the vocabulary, merges, special
ids and chat template live in the metadata under llama.cpp's key names. We rebuild a real
`tokenizers.Tokenizer` from them so that encoding runs in the Rust BPE implementation rather than in Python.

Two places define what "correct" means and we follow both: llama.cpp decides how text is split before BPE
(`tokenizer.ggml.pre`), and the model's original Hugging Face tokenizer decides everything the GGUF was
converted from. For SmolLM2 ('smollm') both split every digit on its own before the GPT-2 byte-level regex.
transformers' own GGUF loader skips that digit split, so it disagrees with both on some text containing
digits (two spaces before a digit, "  1", is the common case); on text without digits the ids are identical.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE

__all__ = ["Tokenizer", "IncrementalDetokenizer", "validate_messages"]

# llama.cpp token types (`tokenizer.ggml.token_type`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Special tokens that end an assistant turn in the common chat formats. A model's `eos` is often the
# end-of-document token, while the chat template closes a turn with one of these; generation must stop on
# either. llama.cpp keeps a similar list ("end of generation" tokens).
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> (split each digit off first, regex that cuts the text before BPE). Mirrors the
# `regex_exprs` llama.cpp picks per pre-type. An unknown pre-type is refused rather than guessed, because a
# wrong split silently produces ids the model was never trained on.
_PRE_TOKENIZER_SPLITS: dict[str, tuple[bool, str]] = {
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), (True, _GPT2_SPLIT)
    ),
    **dict.fromkeys(("gpt2", "default", "mpt", "olmo", "jais", "trillion"), (False, _GPT2_SPLIT)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), (False, _LLAMA3_SPLIT)
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (False, _QWEN2_SPLIT)),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which is how byte-level vocabularies spell bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token either as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def validate_messages(messages: object) -> list[dict[str, str]]:
    """Check a chat before it reaches the template.

    Templates index `message['role']` and concatenate `message['content']`; a missing key or a non-string
    there surfaces as an opaque Jinja error, or worse, renders "None" into the prompt. We fail early instead.
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must contain at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{index}] has no {key!r}")
            if not isinstance(message[key], str):
                raise ValueError(
                    f"messages[{index}][{key!r}] must be a str, got {type(message[key]).__name__}"
                )
        extra = sorted(str(key) for key in message if key not in ("role", "content"))
        if extra:
            raise ValueError(f"messages[{index}] has unsupported keys {extra}; only 'role' and 'content'")
    return messages


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile the way transformers does, so templates written for it render identically here.

    Templates come from model files, i.e. from strangers, hence the immutable sandbox.
    """

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
        # Jinja's own tojson HTML-escapes, which would corrupt prompts containing <, > or &.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the engine needs around it: special ids, stop ids, chat template."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            index for index, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self.stop_token_ids = self._stop_ids(extra_stop_ids)
        self._template = _compile_chat_template(chat_template) if chat_template else None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _stop_ids(self, extra: Iterable[int]) -> tuple[int, ...]:
        """eos first, then end-of-turn tokens, but only ones marked special: plain text must never stop
        generation."""
        ids: list[int] = [] if self.eos_token_id is None else [self.eos_token_id]
        extra = list(extra)
        candidates = [self.backend.token_to_id(token) for token in _END_OF_TURN_TOKENS]
        for index in extra + [i for i in candidates if i in self.special_token_ids]:
            if index is not None and index not in ids:
                ids.append(index)
        return tuple(ids)

    # ----------------------------------------------------------------------------------------- loading

    @classmethod
    def from_gguf(cls, source: str | Path | gguf.GGUFReader) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (byte-level BPE, `tokenizer.ggml.model` = 'gpt2').

        Opening a GGUFReader costs seconds (it indexes every metadata array element), so a caller that
        also loads the weights should pass its reader instead of a path.
        """
        reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(str(source))
        path = getattr(reader.data, "filename", None) or "GGUF file"  # for error messages only
        model = _field(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') GGUF tokenizers "
                "are supported, pass the Hugging Face model directory instead"
            )
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZER_SPLITS:
            raise ValueError(f"{path}: unsupported pre-tokenizer type tokenizer.ggml.pre={pre!r}")
        tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
        token_types: list[int] = list(_field(reader, "tokenizer.ggml.token_type", []))
        merges: list[str] = list(_field(reader, "tokenizer.ggml.merges", []))

        # Every normal token is spelled in GPT-2's byte alphabet. A token that is not (some control tokens)
        # is spelled in plain UTF-8 and has to be respelled, or BPE could never produce it.
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
            for index, token in enumerate(tokens)
        }
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
        backend = _HFTokenizer(
            BPE(vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False, byte_fallback=False)
        )
        split_digits, split = _PRE_TOKENIZER_SPLITS[pre]
        steps: list[pre_tokenizers.PreTokenizer] = []
        if split_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if split == _GPT2_SPLIT:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()

        # Control tokens must be matched whole in text (a chat template writes "<|im_start|>" literally) and
        # are hidden by skip_special_tokens; user-defined ones are matched whole but are ordinary text.
        types = dict(enumerate(token_types))
        control = [t for i, t in enumerate(tokens) if types.get(i) == _TOKEN_TYPE_CONTROL and t in vocab]
        user = [t for i, t in enumerate(tokens) if types.get(i) == _TOKEN_TYPE_USER_DEFINED and t in vocab]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

        def token_at(key: str) -> str | None:
            index = _field(reader, key)
            return None if index is None or not 0 <= index < len(tokens) else tokens[index]

        bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
        # Absent flags mean "no": that is what transformers does for byte-level GGUF vocabularies, and this
        # file (SmolLM2) says False explicitly -- its bos id is <|im_start|>, which the chat template writes.
        add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            head = [bos] if add_bos else []
            tail = [eos] if add_eos else []
            ids = {
                bos: _field(reader, "tokenizer.ggml.bos_token_id"),
                eos: _field(reader, "tokenizer.ggml.eos_token_id"),
            }
            backend.post_processor = processors.TemplateProcessing(
                single=" ".join([*head, "$A", *tail]),
                pair=" ".join([*head, "$A", *tail, "$B:1", *tail]),
                special_tokens=[(t, ids[t]) for t in dict.fromkeys(head + tail)],
            )
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            unk_token=token_at("tokenizer.ggml.unknown_token_id"),
            pad_token=token_at("tokenizer.ggml.padding_token_id"),
            chat_template=_field(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face model directory: tokenizer.json, plus tokenizer_config.json for the special
        tokens and chat template (or chat_template.jinja, where newer transformers writes it).

        BOS/EOS insertion is whatever tokenizer.json's post-processor says, which is what transformers'
        fast tokenizers do too. generation_config.json's eos ids, when present, become stop ids.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = _HFTokenizer.from_file(str(tokenizer_file))

        def read_json(name: str) -> dict[str, Any]:
            file = folder / name
            return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}

        config = read_json("tokenizer_config.json")
        special_map = read_json("special_tokens_map.json")

        def special(name: str) -> str | None:
            return _token_content(config.get(name)) or _token_content(special_map.get(name))

        template_file = folder / "chat_template.jinja"
        template = config.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
            template = named.get("default")
        eos_ids = read_json("generation_config.json").get("eos_token_id", [])
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else [i for i in eos_ids if isinstance(i, int)]
        return cls(
            backend,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            unk_token=special("unk_token"),
            pad_token=special("pad_token"),
            chat_template=template if isinstance(template, str) else None,
            extra_stop_ids=eos_ids,
        )

    def save_pretrained(self, folder: str | Path) -> None:
        """Write this tokenizer as a Hugging Face folder holds one (tokenizer.json, tokenizer_config.json with
        the special tokens and the chat template, generation_config.json with the stop ids): what
        `from_hf_dir` and transformers read back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  **{name: getattr(self, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                     if getattr(self, name) is not None}}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                      encoding="utf-8")
        generation = {"eos_token_id": list(self.stop_token_ids)}
        if self.bos_token_id is not None:
            generation["bos_token_id"] = self.bos_token_id
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A .gguf file or a Hugging Face directory, whichever the user passed."""
        path = Path(path)
        return cls.from_hf_dir(path) if path.is_dir() else cls.from_gguf(path)

    # ------------------------------------------------------------------------------------------- text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text ("<|im_end|>") are matched whole, as in transformers.

        add_special_tokens adds only what the model file asks for; for SmolLM2 that is nothing.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token can stand for, plus one (a decoder may drop a leading
        space from a token decoded alone, as SentencePiece's do)."""
        texts = self.backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(len(text.encode("utf-8")) for text in texts) + 1

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))`, found without encoding: each token stands for at most
        `max_token_bytes` bytes of the text. Encoding holds the GIL (about 1 s per MB here), so a server
        refuses a text that cannot fit its context with this instead of stalling every other request."""
        return -(-len(text.encode("utf-8").translate(None, self._bytes_without_token)) // self.max_token_bytes)

    @functools.cached_property
    def _bytes_without_token(self) -> bytes:
        """Bytes a byte-level vocabulary has no token for: the pre-tokenizer spells each byte as a character
        and BPE drops one the vocabulary lacks, so they stand for no token (SmolLM2's lacks 21 bytes, six ASCII
        control characters among them: "\x1d" encodes to nothing). Other vocabularies turn every character into
        some token (byte fallback or unknown)."""
        vocab = self.backend.get_vocab()
        spelling = _bytes_to_unicode()
        if spelling[ord(" ")] not in vocab:  # not byte-level
            return b""
        return bytes(b for b in range(256) if spelling[b] not in vocab)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template")
        validate_messages(messages)
        return self._template.render(
            messages=[dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            unk_token=self.unk_token,
            pad_token=self.pad_token,
        )

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The template already writes every special token it wants, so none are added on top (as in
        transformers), which would otherwise double a BOS."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas for streaming responses.

    A single token can end in the middle of a UTF-8 character (emoji and CJK span several byte-level
    tokens), and some decoders change a token's text depending on its neighbours, so decoding tokens one
    by one is wrong. Like vLLM, we decode a short window [prefix_offset:] and emit only what extends past
    the text already emitted from [prefix_offset:read_offset], and only once it does not end in U+FFFD
    (an incomplete character). Windows start where a previous one ended cleanly, so the deltas add up
    to `decode(all_ids)`; `flush()` releases whatever is still held back when the stream ends.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Feed one id; return the text it completes (often "", e.g. mid-character or a skipped special)."""
        self.token_ids.append(int(token_id))
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add_token(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """End of stream: emit what was held back, including U+FFFD for a character that never completed,
        exactly as `decode` renders it."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
