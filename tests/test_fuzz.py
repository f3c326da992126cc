"""The differential fuzz (``tests/fuzz.py``) on a CI budget: small random steps, every mode,
estimator and edge it draws, against the float32 spec. The GPU host runs it at engine sizes:
``python3 tests/fuzz.py --configs 10000 --large``."""

import random

import fuzz
import pytest
import torch
from helpers import DEVICE

CONFIGS = 120  # about 100 s in Triton's CPU interpreter


@pytest.mark.parametrize("part", range(4))
def test_random_steps_match_the_spec(part):
    rng = random.Random(1000 + part)
    failures = []
    for _ in range(CONFIGS // 4):
        config = fuzz.draw(rng, DEVICE, large=False)
        problems = fuzz.check(config, DEVICE)
        if problems:
            failures.append((problems[:2], config))
    assert not failures, failures[:3]


def test_the_draws_cover_the_edges():
    """What the budget must reach: padded rows, full pages, every mode and estimator."""
    rng = random.Random(1000)
    configs = [fuzz.draw(rng, "cpu", large=False) for _ in range(CONFIGS)]
    lengths = [n for config in configs for n in config["lengths"]]
    assert min(lengths) <= 0 and any(n > 0 and n % 64 == 0 for n in lengths)
    assert {config["mode"] for config in configs} == {"gamma", "gamma1", "top_k", "fractions"}
    assert {config["estimator"] for config in configs} == {"mvar", "int2", "int4"}
    assert any(config["dense_below_pages"] for config in configs)
    assert torch.tensor([config["group"] for config in configs]).unique().numel() >= 5
