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
    prompt, _ = place_needles(haystack, encode, context, preamble, needles, depths, question)
    return RetrievalSample(prompt, numbers[0], kind, depth)


def repeated_passage(passage, filler, context):
    """``passage + filler + passage``, ``context`` tokens in all; returns the ids and the index
    where the second copy starts."""
    gap = context - 2 * len(passage)
    if gap < 0 or len(filler) < gap:
        raise ValueError(f"cannot fit two {len(passage)}-token passages in {context} tokens "
                         f"with {len(filler)} filler tokens")
    ids = list(passage) + list(filler[:gap]) + list(passage)
    return ids, len(passage) + gap


# --------------------------------------------------------------------------------------------
# Harder retrieval (RULER-style): short needles in prose or in code
# --------------------------------------------------------------------------------------------

NEEDLE_NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivo",
                "Jana", "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya"]
NEEDLE_THINGS = ["harbor", "lantern", "orchard", "violin", "glacier", "compass", "meadow",
                 "falcon", "cellar", "tunnel", "beacon", "quarry", "saddle", "kettle"]
CODE_WORDS = ["data", "items", "total", "count", "index", "value", "result", "buffer", "node",
              "level", "offset", "size", "limit", "state", "cache", "name", "path", "row"]


@dataclasses.dataclass
class NeedleSample:
    """A retrieval prompt; the greedy continuation is correct when ``check_answer`` accepts it:
    it starts with ``answers[0]`` (one answer), or holds every one of ``answers`` (several
    values asked at once)."""

    prompt: list[int]
    answers: tuple[str, ...]
    task: str
    depth: float  # where in the haystack the asked needle sits, 0 = start
    needle_tokens: int  # tokens of the longest needle (all are shorter than a page)


def check_answer(text, answers):
    """Whether a greedy continuation ``text`` answers: it starts with the answer (after
    whitespace), or, for several answers, holds each of them."""
    text = text.strip()
    if len(answers) == 1:
        return text.startswith(answers[0])
    return all(answer in text for answer in answers)


def may_still_answer(text, answers):
    """Whether a continuation ``text`` could still become a correct answer (one answer: the
    text so far is a prefix of it); several answers: always (the caller caps the length)."""
    text = text.strip()
    return len(answers) > 1 or answers[0].startswith(text) or text.startswith(answers[0])


def code_haystack(lines, seed=0):
    """``lines`` lines of synthetic Python-like code (functions, loops, small-number
    assignments, comments), deterministic from ``seed``: a haystack unlike prose."""
    rng = random.Random(seed)
    out = []
    while len(out) < lines:
        name = f"{rng.choice(CODE_WORDS)}_{rng.choice(CODE_WORDS)}"
        a, b = rng.sample(CODE_WORDS, 2)
        out.append(f"def {name}({a}, {b}):")
        for _ in range(rng.randrange(2, 6)):
            var, other = rng.choice(CODE_WORDS), rng.choice(CODE_WORDS)
            form = rng.randrange(5)
            if form == 0:
                out.append(f"    {var} = {other} + {rng.randrange(1, 99)}")
            elif form == 1:
                out.append(f"    for {var} in range({rng.randrange(2, 50)}):")
                out.append(f"        {other} += {var} * {rng.randrange(1, 9)}")
            elif form == 2:
                out.append(f"    if {var} > {rng.randrange(0, 99)}:")
                out.append(f"        {other} = {var} // {rng.randrange(2, 9)}")
            elif form == 3:
                out.append(f"    # update the {var} before the {other} is read")
            else:
                out.append(f"    {var} = {rng.choice(CODE_WORDS)}[{rng.randrange(0, 16)}]")
        out.append(f"    return {rng.choice(CODE_WORDS)}")
        out.append("")
    return "\n".join(out[:lines]) + "\n"


def _uuid_like(rng):
    return f"{rng.getrandbits(24):06x}"


def place_needles(haystack, encode, context, preamble, needles, depths, question):
    """``preamble + haystack with each needle at its depth + question``, ``context`` tokens
    in all (the haystack trimmed to fit). Returns ``(prompt ids, longest needle's tokens)``."""
    preamble_ids, question_ids = encode(preamble), encode(question)
    needle_ids = [encode(needle) for needle in needles]
    filler = context - len(preamble_ids) - len(question_ids) - sum(map(len, needle_ids))
    if filler <= 0 or len(haystack) < filler:
        raise ValueError(f"context {context} is too short for the needles, or the haystack "
                         f"({len(haystack)} tokens) too short for the filler ({filler})")
    prompt = list(haystack[:filler])
    # insert from the deepest needle up, so earlier insertion points stay valid
    for ids, at in sorted(zip(needle_ids, depths), key=lambda pair: -pair[1]):
        position = int(at * filler)
        prompt[position:position] = ids
    return preamble_ids + prompt + question_ids, max(map(len, needle_ids))


def _spread(depth, count):
    """``count`` depths: ``depth`` first, the others evenly around the haystack."""
    return [depth] + [(depth + (i + 1) / count) % 1.0 for i in range(count - 1)]


NEEDLE_TASKS = ("fact", "multikey", "multivalue", "uuid", "code-kv", "code-uuid", "vartrack")


def needle_task(task, haystack, encode, context, *, depth=0.5, seed=0):
    """One sample of a RULER-style task, deterministic from ``seed``. ``haystack``: token ids
    of prose (Paul Graham's essays) or, for the ``code-*`` tasks, of ``code_haystack``.

    - ``fact``: one line "The secret number of the T is N." (a 5-digit N) at ``depth``.
    - ``multikey``: four such lines for different names, one asked.
    - ``multivalue``: two numbers for one name in two lines, both asked.
    - ``uuid``: four "The access code for NAME is X." lines, X six hex digits, one asked.
    - ``code-kv`` / ``code-uuid``: four assignments ``NAME_token = N`` (a 5-digit number / a
      quoted 6-hex-digit string) in code, one asked.
    - ``vartrack``: a chain ``xa = N``, ``xb = xa``, ``xc = xb``, ``xd = xc`` spread over the
      haystack, with a second chain as distractor; the value of the chain's last variable
      asked.
    """
    rng = random.Random(f"{task}:{seed}")
    names = rng.sample(NEEDLE_NAMES, 4)
    if task == "fact":
        thing, number = rng.choice(NEEDLE_THINGS), str(rng.randrange(10**4, 10**5))
        preamble = ("A secret number is hidden in the following text. Memorize it; you will be "
                    "asked about it.\n")
        needles = [f" The secret number of the {thing} is {number}."]
        question = f"\nWhat is the secret number of the {thing}? The secret number of the " \
                   f"{thing} is"
        answers, depths = (number,), [depth]
    elif task in ("multikey", "uuid"):
        word = "secret number" if task == "multikey" else "access code"
        values = [str(rng.randrange(10**4, 10**5)) if task == "multikey" else _uuid_like(rng)
                  for _ in names]
        preamble = (f"Several {word}s are hidden in the following text. Memorize them; you "
                    f"will be asked about one.\n")
        needles = [f" The {word} for {name} is {value}." for name, value in zip(names, values)]
        question = f"\nWhat is the {word} for {names[0]}? The {word} for {names[0]} is"
        answers, depths = (values[0],), _spread(depth, len(needles))
    elif task == "multivalue":
        values = [str(rng.randrange(10**4, 10**5)) for _ in range(2)]
        preamble = ("Secret numbers are hidden in the following text. Memorize them; you will "
                    "be asked about them.\n")
        needles = [f" One of the secret numbers for {names[0]} is {value}." for value in values]
        question = f"\nWhat are the two secret numbers for {names[0]}? They are"
        answers, depths = tuple(values), _spread(depth, 2)
    elif task in ("code-kv", "code-uuid"):
        keys = [f"{name.lower()}_token" for name in names]
        values = [str(rng.randrange(10**4, 10**5)) if task == "code-kv"
                  else f'"{_uuid_like(rng)}"' for _ in names]
        preamble = "# Configuration values are set in the code below. Remember them.\n"
        needles = [f"\n{key} = {value}\n" for key, value in zip(keys, values)]
        question = f"\n# Question: what is {keys[0]}?\n{keys[0]} ="
        answers, depths = (values[0],), _spread(depth, len(needles))
    elif task == "vartrack":
        letters = rng.sample("abcdefghjkmnpqrstuvwz", 8)
        chain, other = [f"x{c}" for c in letters[:4]], [f"x{c}" for c in letters[4:]]
        value, decoy = (str(rng.randrange(10**4, 10**5)) for _ in range(2))
        preamble = ("Memorize the variable assignments hidden in the following text; you will "
                    "be asked about one variable.\n")
        needles, depths = [], []
        for vars_, start, offset in ((chain, value, 0.0), (other, decoy, 0.5 / 4)):
            for hop, var in enumerate(vars_):
                source = start if hop == 0 else vars_[hop - 1]
                needles.append(f" VAR {var} = {source}.")
                depths.append((depth * 0.2 + hop / 4 + offset) % 1.0)
        question = f"\nWhat is the value of VAR {chain[-1]}? VAR {chain[-1]} ="
        answers = (value,)
        depth = depths[0]
    else:
        raise ValueError(f"task must be one of {NEEDLE_TASKS}, got {task!r}")
    prompt, longest = place_needles(haystack, encode, context, preamble, needles, depths,
                                    question)
    return NeedleSample(prompt, answers, task, depth, longest)
