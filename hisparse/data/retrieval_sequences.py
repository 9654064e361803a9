"""Passkey-style retrieval sequences built from the training split, for the indexer's dense warm-up.

Plain documentation text seldom makes the model copy a span from thousands of tokens back, so the
warm-up's random query rows almost never show the indexer a query whose attention sits on one far,
short span; passkey retrieval needs exactly that (the answer digits are copied from the needle). Each
sequence here is training text with a needle sentence holding a random 5-digit number at a random
depth, then a question and the answer. The target stays the frozen model's own attention (DSA's
recipe): only the data changes. The phrasings differ from the quality report's passkey sentence, and the
filler is the training split, so the report's held-out passkey prompts stay unseen.
"""

from __future__ import annotations

import numpy as np

TEMPLATES = [  # (needle, question): the answer is " {key}."
    ("\nThe secret code is {key}. Keep it in mind. {key} is the secret code.\n",
     "\nWhat is the secret code? The secret code is"),
    ("\nRemember this number: {key}. The number to remember is {key}.\n",
     "\nWhich number was to be remembered? The number is"),
    ("\nThe access key is {key}. Do not forget it: {key}.\n",
     "\nWhat is the access key? The access key is"),
]


def retrieval_sequence(tokenizer, filler: list[int], length: int, rng: np.random.Generator) -> tuple[list[int], int]:
    """(ids, answer_rows): exactly `length` tokens of filler (read from a random offset of the `filler`
    stream) with a needle at a random depth, then the question and the answer. The last `answer_rows`
    positions (the question's last token and the answer's tokens but the last) are the queries whose
    next token is copied from the needle."""
    key = int(rng.integers(10000, 100000))
    needle_text, question_text = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    needle = tokenizer.encode(needle_text.format(key=key))
    question = tokenizer.encode(question_text)
    answer = tokenizer.encode(f" {key}.")
    body = length - len(needle) - len(question) - len(answer)
    if body <= 0 or len(filler) < body:
        raise ValueError(f"a retrieval sequence of {length} tokens needs at least {max(body, 1)} filler tokens "
                         f"(have {len(filler)})")
    start = int(rng.integers(0, len(filler) - body + 1))
    text = filler[start:start + body]
    at = int(rng.uniform(0.05, 0.95) * body)
    ids = text[:at] + needle + text[at:] + question + answer
    return ids, len(answer)
