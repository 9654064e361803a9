"""The Python documentation shipped in the standard library, as a deterministic train/held-out corpus.

`pydoc_data.topics.topics` holds the language reference and library topics that `help()` shows: about
465k characters of English technical prose in 79 topics (CPython 3.11), present on every machine with
Python. Topics are taken in sorted-key order; every 10th (index 6, 16, 26, ...) is held out and never
used for training: 8 topics, about 13.3k tokens (12%), among them two long ones ("debugger",
"formatstrings"), so the held-out stream has enough coherent text for an 8k-token context. Each split
is one token stream: its topics joined by blank lines, then tokenized.
"""

from __future__ import annotations

HELD_OUT_EVERY = 10
HELD_OUT_PHASE = 6


def topic_names(split: str) -> list[str]:
    from pydoc_data.topics import topics

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    names = sorted(topics)
    held = {name for i, name in enumerate(names) if i % HELD_OUT_EVERY == HELD_OUT_PHASE}
    return [n for n in names if (n in held) == (split == "heldout")]


def corpus_text(split: str) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in topic_names(split))


def corpus_tokens(tokenizer, split: str) -> list[int]:
    return tokenizer.encode(corpus_text(split))


def heldout_tokens(tokenizer, length: int, offset: int = 0) -> list[int]:
    """`length` held-out tokens starting at `offset`; the stream repeats if it is too short."""
    ids = corpus_tokens(tokenizer, "heldout")
    while len(ids) < offset + length:
        ids = ids + ids
    return ids[offset:offset + length]
