"""The tokenizer rebuilt from the embedded GGUF, checked against transformers reading the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hisparse.models.default_model import default_model_path
from hisparse.models.tokenizer import IncrementalDetokenizer, Tokenizer, validate_messages

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "tabs\tand\nnewlines\r\n   runs of    spaces   \n\n\n",
    "emoji: 😀👍🏽🇺🇸 ❤️ and a family 👨‍👩‍👧",
    "中文：你好，世界！日本語のテキスト、한국어 텍스트",
    "Café naïve résumé façade Ångström",
    "numbers 12345, 3.14159 and 1,000,000",
    "",
    " ",
]

# Strings on which transformers' GGUF loader and SmolLM2's own tokenizer agree (see test_digit_split).
AGREEING = [s for s in SAMPLES if s] + ["<|im_start|>user\nhi<|im_end|>\n", "x = 3\n\ty = [1, 2]"]

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi 👋"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "再说一次"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def test_special_ids(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == hf_tok.bos_token_id == 1  # <|im_start|>
    assert tok.eos_token_id == hf_tok.eos_token_id == 2  # <|im_end|>
    assert tok.stop_token_ids[0] == tok.eos_token_id
    assert set(tok.stop_token_ids) == {
        tok.backend.token_to_id("<|im_end|>"),
        tok.backend.token_to_id("<|endoftext|>"),
    }


def test_no_bos_added_like_transformers(tok: Tokenizer, hf_tok) -> None:
    # The file says add_bos_token=False; its "bos" is <|im_start|>, which the chat template writes itself.
    assert tok.encode("Hello") == hf_tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello")[0] != tok.bos_token_id


@pytest.mark.parametrize("text", AGREEING)
def test_ids_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_digit_split(tok: Tokenizer, hf_tok) -> None:
    """llama.cpp's 'smollm' pre-type and SmolLM2's tokenizer.json both cut every digit off before the GPT-2
    regex; transformers' GGUF loader does not, so two spaces before a digit stay unmerged there."""
    text = "a  1"
    assert tok.encode(text) == tok.encode("a  ") + tok.encode("1")
    assert tok.encode(text) == [81, 256, 33]  # a, "ĠĠ", 1
    assert hf_tok.encode(text) == [81, 216, 216, 33]
    assert tok.encode("12345") == [tok.backend.token_to_id(d) for d in "12345"]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, messages, add_generation_prompt) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<|im_start|>")
    if add_generation_prompt:
        assert ours.endswith("<|im_start|>assistant\n")
    encoded = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == encoded["input_ids"]


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ("hi", "must be a list"),
        ([], "at least one"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user"}], "has no 'content'"),
        ([{"content": "x"}], "has no 'role'"),
        ([{"role": "user", "content": None}], r"\['content'\] must be a str"),
        ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], r"messages\[1\]\['role'\]"),
        ([{"role": "user", "content": "a", "name": "bob"}], "unsupported keys"),
    ],
)
def test_message_validation(tok: Tokenizer, messages, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=problem):
        validate_messages(messages)


def test_from_hf_dir(tmp_path: Path, hf_tok) -> None:
    """A directory saved by transformers: its tokenizer.json carries transformers' own pre-tokenizer, so
    here the ids must agree on every string, digits after spaces included."""
    hf_tok.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id)
    for text in [*SAMPLES, "a  1"]:
        assert loaded.encode(text) == hf_tok.encode(text)
    for messages in CHATS:
        assert loaded.apply_chat_template(messages) == hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_from_hf_dir_config_template(tmp_path: Path, tok: Tokenizer) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "chat_template": tok.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_path(tmp_path)
    assert loaded.encode("a  1") == tok.encode("a  1")
    assert loaded.stop_token_ids == (2, 0)
    assert loaded.apply_chat_template(CHATS[1]) == tok.apply_chat_template(CHATS[1])


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_token(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_never_splits_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_incremental_holds_back_partial_emoji(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # a single emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add_token(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_token(ids[-1]) == "😀"
    # A stream that stops mid-character ends the way decode renders it.
    cut = IncrementalDetokenizer(tok)
    assert cut.add_tokens(ids[:-1]) == ""
    assert cut.flush() == tok.decode(ids[:-1]) == "\ufffd"


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode_chat(CHATS[1]) + tok.encode("Sure — 你好 🙂<|im_end|>")
    assert "".join(stream(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_bytes_missing_from_vocabulary_are_dropped(tok: Tokenizer, hf_tok) -> None:
    """SmolLM2's BPE was trained without a few byte symbols (some C0 controls, UTF-8 lead bytes F1/F2) and
    has no unk token, so those bytes vanish -- in transformers and in the original tokenizer alike."""
    assert tok.encode("a\x16b") == hf_tok.encode("a\x16b") == tok.encode("a") + tok.encode("b")
    plane5 = "\U00050000"  # F1 90 80 80: the lead byte is lost, the continuation bytes decode as U+FFFD
    assert tok.encode(plane5) == hf_tok.encode(plane5)
    assert tok.decode(tok.encode(plane5)) == "\ufffd" * 3


# Text the vocabulary can spell: no dropped control bytes, nothing whose UTF-8 starts with F1/F2.
SPELLABLE = st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters="\x04\x06\x13\x14\x16\x1d")
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(text=st.text(SPELLABLE, max_size=60))
@example(text="<|im_end|>")
@example(text="a<|im_start|>b")
def test_property_round_trip_and_stream(tok: Tokenizer, text: str) -> None:
    """A special token written in the text encodes to its id (see `Tokenizer.encode`), so only a decode that
    keeps special tokens gives the text back. Hypothesis draws such strings from the code's constants."""
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    deltas = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in delta for delta in deltas)


@FAST
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40), skip=st.booleans())
def test_property_stream_of_arbitrary_ids(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    """Sampling can produce byte sequences that are not UTF-8 at all; the stream must still add up."""
    assert "".join(stream(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)


@FAST
@given(pieces=st.lists(st.one_of(st.sampled_from(SAMPLES + ["\n" + " " * 80, "#" * 80, "<|im_end|>", "=" * 200]),
                                 st.text(max_size=40)), max_size=12))
@example(pieces=["\x1d"])  # a byte the vocabulary has no token for: it encodes to nothing
@example(pieces=["\U00040000" * 30])  # its lead byte (0xf1) has no token either
def test_min_tokens_never_exceeds_the_real_count(tok, pieces):
    # The server refuses a prompt by this bound before tokenizing it, so it must never overshoot.
    text = "".join(pieces)
    assert tok.min_tokens(text) <= len(tok.encode(text))


def test_min_tokens_knows_which_bytes_stand_for_no_token(tok):
    silent = "".join(chr(b) for b in tok._bytes_without_token if b < 0x80)
    assert silent and tok.encode(silent * 5) == [] and tok.min_tokens(silent * 500) == 0
    assert tok.min_tokens("a" * 1000) == -(-1000 // tok.max_token_bytes)
