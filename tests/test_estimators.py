"""The candidate page-mass estimators of ``moira.estimators`` (study code) on small inputs."""

import math

import torch

from moira import estimators, reference


def _inputs(pages=5, heads=2, group=3, dim=64, tail=10, seed=0):
    torch.manual_seed(seed)
    key_cache = torch.randn(pages, 64, heads, dim)
    block_table = torch.arange(pages, dtype=torch.int32)[None]
    seq_lens = torch.tensor([pages * 64 - tail])
    query = torch.randn(1, heads * group, dim)
    return query, key_cache, block_table, seq_lens


def test_exact_and_mvar_match_the_reference():
    query, key_cache, block_table, seq_lens = _inputs()
    keys, valid = estimators.page_keys(key_cache, block_table, seq_lens[0])
    q = query[0].view(2, 3, 64) / 8
    exact = reference.exact_log_masses(query, key_cache, block_table, seq_lens)[0]
    torch.testing.assert_close(estimators.exact(q, keys, valid), exact)
    summaries = reference.summarize(key_cache, block_table, seq_lens)
    spec = reference.estimate(query, key_cache, summaries, block_table, seq_lens)[0]
    ours = estimators.with_exact_ends(estimators.mvar)(q, keys, valid)
    torch.testing.assert_close(ours, spec, rtol=1e-5, atol=1e-4)


def test_bounds_and_quantized_keys():
    query, key_cache, block_table, seq_lens = _inputs()
    keys, valid = estimators.page_keys(key_cache, block_table, seq_lens[0])
    q = query[0].view(2, 3, 64) / 8
    exact = estimators.exact(q, keys, valid)
    for sub in (64, 32, 16):  # Quest's bound over boxes bounds the exact mass from above
        bound = estimators.quest(q, keys, valid, sub=sub)
        assert bool((bound >= exact - 1e-4).all())
    errors = [float((estimators.quantized(q, keys, valid, bits) - exact).abs().max())
              for bits in (1, 2, 4)]
    assert errors[2] < errors[1] < errors[0] and errors[2] < 0.1


def test_a_towering_key_is_seen_by_keys_but_not_by_moments():
    """One key of a page aligned with the query: mvar misses it, a copy of the keys does not."""
    query, key_cache, block_table, seq_lens = _inputs(pages=6, heads=1, group=1, tail=0)
    q = query[0].view(1, 1, 64) / 8
    key_cache = key_cache * 0.3
    key_cache[3, 17, 0] = query[0, 0] * 1.2  # logit ~ 1.2 |q|^2 / 8, towering
    keys, valid = estimators.page_keys(key_cache, block_table, seq_lens[0])
    shares = {name: reference.group_shares(
        estimators.with_exact_ends(fn)(q, keys, valid)[None])[0, 0, 3]
        for name, fn in estimators.CANDIDATES.items()}
    assert shares["exact"] > 0.9
    assert shares["mvar"] < 0.5 * shares["exact"]
    for name in ("int4", "int2", "landmark2-deviation", "landmark1-norm"):
        assert shares[name] > 0.8, name
    for name in estimators.CANDIDATES:
        assert name in estimators.BYTES
    assert estimators.BYTES["mvar"](64) == 256 and estimators.BYTES["int4"](64) == 256 + 2048
    assert not math.isnan(float(shares["two-stage quest/int2 50%"]))
