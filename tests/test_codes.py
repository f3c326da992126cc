"""The int2 / int4 estimators: the codes' layout and quantization (spec), the Triton summarize
and Estimate against it, and the whole step with each estimator."""

import math

import pytest
import torch
from helpers import DEVICE, make_cache, make_query, make_table, poisoned

import moira
from moira import reference as ref
from moira.config import ESTIMATOR_BITS, PAGE_SIZE, summary_rows
from moira.kernels.triton.estimate import estimate

CODED = ["int2", "int4"]


def coded_summaries(keys, table, seq_lens, estimator, dtype=torch.bfloat16):
    num_pages, _, num_kv_heads, head_dim = keys.shape
    rows = summary_rows(estimator, torch.tensor([], dtype=dtype).element_size())
    return torch.zeros(num_pages, num_kv_heads, rows, head_dim, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (PAGE_SIZE, 3, 128))
    packed = ref.pack_codes(codes, bits)
    assert packed.shape == (3, PAGE_SIZE * 128 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(ref.unpack_codes(packed, bits, 128), codes.permute(1, 0, 2))
    # byte j of token 0 holds channel j in its lowest bits, channel j + D * bits / 8 next
    width = 128 * bits // 8
    assert int(packed[0, 5]) & (2**bits - 1) == int(codes[0, 0, 5])
    assert (int(packed[0, 5]) >> bits) & (2**bits - 1) == int(codes[0, 0, 5 + width])


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_page_bounds_and_error(bits):
    keys = torch.randn(PAGE_SIZE, 2, 64) * 3
    keys[:, 1, 7] = 0.5  # a constant channel: step 0, code 0, exact
    lo, hi, codes = ref.quantize_page(keys, bits, torch.float32)
    assert torch.equal(lo, keys.amin(0)) and torch.equal(hi, keys.amax(0))
    step = (hi - lo) / (2**bits - 1)
    dequantized = lo + codes * step
    assert ((dequantized - keys).abs() <= step / 2 + 1e-6).all()
    assert (codes[:, 1, 7] == 0).all() and (dequantized[:, 1, 7] == 0.5).all()
    # the extreme keys of a channel are coded exactly
    assert torch.equal(codes.amax(0)[step > 0], torch.full_like(codes.amax(0)[step > 0],
                                                                2**bits - 1))


@pytest.mark.parametrize("estimator", CODED)
@pytest.mark.parametrize("layout", ["contiguous", "packed_hnd"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("summary_dtype", [torch.float32, torch.bfloat16])
def test_summarize_codes_match_reference(estimator, layout, head_dim, summary_dtype):
    keys, _ = make_cache(24, 2, head_dim, layout=layout)
    keys[3, :, 1, 5] = 2.0  # a constant channel on one page
    table, seq_lens = make_table([1, 64, 3 * PAGE_SIZE + 5, 5 * PAGE_SIZE], 24)
    summaries = coded_summaries(keys, table, seq_lens, estimator, summary_dtype)
    summaries.fill_(float("nan"))
    moira.summarize(keys, table, seq_lens, summaries, estimator=estimator)
    expected = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu(),
                             torch.zeros_like(summaries, device="cpu"), estimator)
    full = [p for b, n in enumerate(seq_lens.tolist()) for p in table[b, :n // PAGE_SIZE].tolist()]
    others = sorted(set(range(24)) - set(full))
    assert torch.isnan(summaries[others].float()).all()  # pages no row fills: untouched
    got = summaries[full].cpu()
    assert torch.equal(got[:, :, :2], expected[full][:, :, :2])  # min and max: exact
    bits = ESTIMATOR_BITS[estimator]
    got_codes = ref.unpack_codes(ref.code_bytes(got), bits, head_dim)
    want_codes = ref.unpack_codes(ref.code_bytes(expected[full]), bits, head_dim)
    # a key within float32 rounding of a half step may round either way: nothing else may
    lo, hi = expected[full][:, :, 0].float(), expected[full][:, :, 1].float()
    step = ((hi - lo) / (2**bits - 1))[:, :, None]
    scaled = (keys[full].float().cpu().permute(0, 2, 1, 3) - lo[:, :, None]) / \
        torch.where(step > 0, step, 1.0)
    near_half = ((scaled - scaled.floor() - 0.5).abs() < 1e-4) & (step > 0)
    assert torch.equal(got_codes[~near_half], want_codes[~near_half])
    assert ((got_codes - want_codes).abs() <= 1).all()


@pytest.mark.parametrize("estimator", CODED)
def test_update_summaries_writes_codes_of_filled_pages(estimator):
    keys, _ = make_cache(10, 2, 64)
    summaries = coded_summaries(keys, None, None, estimator)
    slots = torch.tensor([3 * PAGE_SIZE + 63, 5 * PAGE_SIZE + 10, -1], device=DEVICE)
    moira.update_summaries(keys, slots, summaries, estimator=estimator)
    table = torch.tensor([[3]], dtype=torch.int32)
    expected = ref.summarize(keys.cpu(), table, torch.tensor([PAGE_SIZE]),
                             torch.zeros_like(summaries, device="cpu"), estimator)
    assert torch.equal(summaries[3, :, :2].cpu(), expected[3, :, :2])
    bits = ESTIMATOR_BITS[estimator]
    got, want = (ref.unpack_codes(ref.code_bytes(s[3:4].cpu()), bits, 64)
                 for s in (summaries, expected))
    assert (got - want).abs().max() <= 1 and (got != want).float().mean() < 1e-3
    assert (summaries[5] == 0).all() and (summaries[[0, 1, 2, 4, 6, 7, 8, 9]] == 0).all()


def _dot_tolerance(query, summaries, table, seq_lens, scale, group):
    """Per row and head, the largest error the codes' products (tf32x3: about float32's
    precision) may add to a page's log-mass: 2**-16 * sum_c |s q_c| (hi_c - lo_c) over its
    pages, generous against tf32x3's ~2**-21 (the interpreter computes in float32)."""
    batch, num_heads, _ = query.shape
    num_kv_heads = summaries.shape[1]
    q = (query.float().cpu() * scale).view(batch, num_kv_heads, group, -1).abs()
    spread = (summaries[:, :, 1].float() - summaries[:, :, 0].float()).cpu()
    widest = spread[table.long().cpu()].amax(1)  # [batch, Hkv, D] over each row's pages
    return 1e-4 + 2**-16 * torch.einsum("bhgd,bhd->bhg", q, widest)[..., None]


@pytest.mark.parametrize("estimator", CODED)
@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_estimate_codes_match_reference(estimator, group, head_dim):
    num_kv_heads = 2
    keys, _ = make_cache(180, num_kv_heads, head_dim, layout="packed")
    lengths = [3, 128, 64 * 40 + 5, 64 * 9]  # one row over two 32-page tiles
    table, seq_lens = make_table(lengths, 180)
    query = make_query(len(lengths), num_kv_heads * group, head_dim)
    summaries = moira.summarize(keys, table, seq_lens, estimator=estimator)
    max_pages = table.shape[1]
    log_masses = poisoned(len(lengths) * num_kv_heads, group, max_pages, dtype=torch.float32)
    scale = 1.3 / math.sqrt(head_dim)
    estimate(query, keys, summaries, table, seq_lens, scale, log_masses,
             moira.KernelOptions(estimate="triton"), bits=ESTIMATOR_BITS[estimator])
    expected = ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(), table.cpu(),
                            seq_lens.cpu(), scale, estimator)
    got = log_masses.cpu().view_as(expected)
    tolerance = _dot_tolerance(query, summaries, table, seq_lens, scale, group)
    for b, length in enumerate(lengths):
        pages = ref.num_pages(length, max_pages)
        error = (got[b, :, :, :pages] - expected[b, :, :, :pages]).abs()
        assert (error <= tolerance[b]).all(), f"row {b}: error {error.max():.2e}"
        assert torch.isnan(got[b, :, :, pages:]).all()  # past the row: not written


def test_codes_see_a_towering_key_that_mvar_misses():
    """One key of a page aligned with the query (a short needle): its page holds most of the
    mass; int2 ranks it first, mvar ranks a page of widely spread keys above it (the needle
    barely moves its page's mean and variance; docs/design/estimate.md)."""
    torch.manual_seed(3)
    head_dim, pages = 64, 12
    keys = torch.randn(pages, PAGE_SIZE, 1, head_dim) * 0.3
    query = torch.randn(1, 1, head_dim)
    needle = query[0, 0] / query[0, 0].norm() * 24  # logit 3 x sqrt(64) above the others
    keys[6, 17, 0] = needle
    keys[4] *= 6  # wide but needle-free: mvar's variance term makes it the heaviest
    table = torch.arange(pages, dtype=torch.int32)[None]
    seq_lens = torch.tensor([pages * PAGE_SIZE - 10], dtype=torch.int32)
    exact = ref.exact_log_masses(query, keys, table, seq_lens)[0, 0, 0]
    assert int(exact[1:-1].argmax()) + 1 == 6
    for estimator, ranked_first in (("int2", True), ("int4", True), ("mvar", False)):
        summaries = ref.summarize(keys, table, seq_lens, estimator=estimator)
        estimated = ref.estimate(query, keys, summaries, table, seq_lens,
                                 estimator=estimator)[0, 0, 0]
        assert (int(estimated[1:-1].argmax()) + 1 == 6) == ranked_first, estimator


@pytest.mark.parametrize("estimator", CODED)
def test_sparse_decode_with_codes_matches_reference(estimator):
    num_kv_heads, group, head_dim = 2, 4, 64
    keys, values = make_cache(60, num_kv_heads, head_dim)
    lengths = [64 * 12 + 7, 64 * 9, 40]
    table, seq_lens = make_table(lengths, 60)
    query = make_query(len(lengths), num_kv_heads * group, head_dim)
    config = moira.MoiraConfig(estimator=estimator, gamma=0.9)
    summaries = moira.summarize(keys, table, seq_lens, estimator=estimator)
    out, lists, counts = moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                             config=config, return_pages=True)
    ref_out, ref_lists, ref_counts = ref.sparse_decode(
        query.cpu(), keys.cpu(), values.cpu(), summaries.cpu(), table.cpu(), seq_lens.cpu(),
        config=config, return_pages=True)
    shares = ref.group_shares(ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(),
                                           table.cpu(), seq_lens.cpu(), estimator=estimator))
    for b in range(len(lengths)):
        for h in range(num_kv_heads):
            got = set(lists[b, h, : counts[b, h]].tolist())
            want = set(ref_lists[b, h, : ref_counts[b, h]].tolist())
            edge = min(shares[b, h, sorted(want)].tolist())
            # the same pages, but where a share lies within rounding of the threshold
            assert all(abs(float(shares[b, h, p]) - edge) <= 1e-5 for p in got ^ want)
    lists_and_counts = (lists.cpu(), counts.cpu())
    kernel_pages = ref.attend(query.cpu(), keys.cpu(), values.cpu(), table.cpu(),
                              seq_lens.cpu(), *lists_and_counts)
    torch.testing.assert_close(out.float().cpu(), kernel_pages, rtol=2e-2, atol=2e-2)
    assert torch.equal(counts.cpu(), ref_counts)  # on these inputs no share is that close


def test_summaries_must_match_the_estimator():
    keys, values = make_cache(8, 1, 64)
    table, seq_lens = make_table([200], 8)
    query = make_query(1, 4, 64)
    mvar = moira.summarize(keys, table, seq_lens)
    with pytest.raises(ValueError, match="built for estimator='mvar'"):
        moira.sparse_decode(query, keys, values, mvar, table, seq_lens,
                            config=moira.MoiraConfig(estimator="int2"))
    with pytest.raises(ValueError, match="estimator must be one of"):
        moira.summarize(keys, table, seq_lens, estimator="int3")
    with pytest.raises(ValueError, match="estimator must be one of"):
        moira.MoiraConfig(estimator="quest")
    coded = moira.summarize(keys, table, seq_lens, estimator="int2")
    with pytest.raises(ValueError, match="contiguous rows"):
        moira.sparse_decode(query, keys, values, coded.transpose(2, 3).contiguous()
                            .transpose(2, 3), table, seq_lens,
                            config=moira.MoiraConfig(estimator="int2"))


@pytest.mark.parametrize("estimator", CODED)
def test_a_nan_key_makes_its_page_unreadable_not_dropped(estimator):
    """A NaN key: its channel's min is NaN in the summary (tl.min alone would skip it), the
    page's estimate NaN, and Select keeps the page."""
    keys, values = make_cache(24, 1, 64)
    table, seq_lens = make_table([64 * 10 + 3], 24)
    page = int(table[0, 5])
    keys[page, 9, 0, 3] = float("nan")
    summaries = moira.summarize(keys, table, seq_lens, estimator=estimator)
    assert torch.isnan(summaries[page, 0, 0, 3]) and not torch.isnan(summaries[page, 0, 1]).any()
    expected = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu(),
                             torch.zeros_like(summaries, device="cpu"), estimator)
    assert torch.equal(summaries[page, :, :2].cpu().isnan(), expected[page, :, :2].isnan())
    query = make_query(1, 4, 64)
    _, lists, counts = moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                           gamma=0.3, return_pages=True,
                                           config=moira.MoiraConfig(estimator=estimator))
    assert 5 in lists[0, 0, : counts[0, 0]].tolist()
