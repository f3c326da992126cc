"""Inputs for the accuracy measurements, built from any long text and a tokenizer.

Every builder takes ``encode(text) -> list[int]`` and returns token ids, so the harness runs
with any tokenizer (and, in the tests, with a byte-level one).
"""

from __future__ import annotations

import dataclasses
import json
import random

NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana"]


def read_text(path):
    """The long text to sample from: a plain UTF-8 text file, or ``{"text": ...}`` in a .json.
    Raises ValueError (with the fix) for a file that holds neither, or no text."""
    usage = 'give a UTF-8 .txt file, or a .json holding {"text": "..."}'
    try:
        with open(path, encoding="utf-8") as f:
            if not path.endswith(".json"):
                text = f.read()
            else:
                data = json.load(f)
                text = data.get("text") if isinstance(data, dict) else None
    except UnicodeDecodeError:
        raise ValueError(f"{path!r} is not UTF-8 text: {usage}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path!r} is not valid JSON ({error}): {usage}") from None
    if not isinstance(text, str):
        raise ValueError(f'{path!r} holds no "text" string: {usage}')
    if not text.strip():
        raise ValueError(f"{path!r} holds no text: {usage}")
    return text


def windows(text_ids, length, count, *, seed=0):
    """``count`` windows of ``length`` tokens from ``text_ids``: non-overlapping ones in a seeded
    random order when the text holds enough, otherwise evenly spaced overlapping ones (long
    contexts on a short text: each window still ends, and is continued, somewhere else)."""
    available = len(text_ids) // length
    if available == 0:
        raise ValueError(f"the text holds {len(text_ids)} tokens, fewer than one window of "
                         f"{length}")
    if available < count:
        if count > len(text_ids) - length + 1:
            raise ValueError(f"the text holds {len(text_ids)} tokens: too few for {count} "
                             f"distinct windows of {length}")
        stride = (len(text_ids) - length) / max(count - 1, 1)
        starts = [round(i * stride) for i in range(count)]
        random.Random(seed).shuffle(starts)
        return [text_ids[start : start + length] for start in starts]
    order = random.Random(seed).sample(range(available), count)
    return [text_ids[i * length : (i + 1) * length] for i in order]


@dataclasses.dataclass
class RetrievalSample:
    prompt: list[int]
    answer: str  # the digits the model must produce
    kind: str  # "single" or "multi"
    depth: float  # where in the haystack the (asked) needle sits, 0 = start


def passkey(haystack, encode, context, *, kind="single", depth=0.5, keys=4, seed=0):
    """A RULER-style pass-key prompt of ``context`` tokens: a preamble announcing the key(s),
    haystack with needle(s), then the question.

    ``kind="single"``: one needle, "The pass key is N. Remember it. N is the pass key.", at
    ``depth`` of the haystack. ``kind="multi"``: ``keys`` needles "The pass key for NAME is N."
    spread through the haystack, the asked one at ``depth``. The prompt ends with the question
    and the start of the answer, so the answer is the continuation's first digits.
    """
    rng = random.Random(seed)
    numbers = [str(rng.randrange(10000, 100000)) for _ in range(keys)]
    if kind == "single":
        preamble = ("A special pass key is hidden within the following text. Make sure to "
                    "memorize it. I will quiz you about it afterwards.\n")
        needles = [f" The pass key is {numbers[0]}. Remember it. {numbers[0]} is the pass key."]
        question = "\nWhat is the pass key? The pass key is"
        depths = [depth]
    elif kind == "multi":
        preamble = ("Several special pass keys are hidden within the following text. Make sure "
                    "to memorize them. I will quiz you about one of them afterwards.\n")
        names = rng.sample(NAMES, keys)
        needles = [f" The pass key for {name} is {number}." for name, number in zip(names, numbers)]
        question = f"\nWhat is the pass key for {names[0]}? The pass key for {names[0]} is"
        others = [(depth + (i + 1) / keys) % 1.0 for i in range(keys - 1)]
        depths = [depth] + others
    else:
        raise ValueError(f"kind must be 'single' or 'multi', got {kind!r}")
    preamble_ids = encode(preamble)
    needle_ids = [encode(needle) for needle in needles]
    question_ids = encode(question)
    filler = context - len(preamble_ids) - len(question_ids) - sum(map(len, needle_ids))
    if filler <= 0 or len(haystack) < filler:
        raise ValueError(f"context {context} is too short for the needles, or the haystack "
                         f"({len(haystack)} tokens) too short for the filler ({filler})")
    prompt = list(haystack[:filler])
    # insert from the deepest needle up, so earlier insertion points stay valid
    for ids, at in sorted(zip(needle_ids, depths), key=lambda pair: -pair[1]):
        position = int(at * filler)
        prompt[position:position] = ids
    return RetrievalSample(preamble_ids + prompt + question_ids, numbers[0], kind, depth)


def repeated_passage(passage, filler, context):
    """``passage + filler + passage``, ``context`` tokens in all; returns the ids and the index
    where the second copy starts."""
    gap = context - 2 * len(passage)
    if gap < 0 or len(filler) < gap:
        raise ValueError(f"cannot fit two {len(passage)}-token passages in {context} tokens "
                         f"with {len(filler)} filler tokens")
    ids = list(passage) + list(filler[:gap]) + list(passage)
    return ids, len(passage) + gap
