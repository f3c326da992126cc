"""The float32 spec checked against the paper's worked examples and against itself."""

import math

import torch

from moira import MoiraConfig
from moira import reference as ref
from moira.config import PAGE_SIZE


def _log_masses_from_shares(shares):
    """A one-row, one-head log-mass tensor whose shares are ``shares``."""
    return torch.tensor(shares).log().view(1, 1, 1, -1)


def test_coverage_rule_paper_example():
    # section 3.2: shares 0.70, 0.20, 0.08, 0.02 (here as middle pages between a tiny sink and
    # current page): gamma 0.9 keeps two of them, 0.98 three. Tested just below 0.9 and 0.98,
    # which are exactly the partial sums, decided by rounding either way.
    shares = [1e-9, 0.70, 0.20, 0.08, 0.02, 1e-9]
    seq_lens = torch.tensor([len(shares) * PAGE_SIZE], dtype=torch.int32)
    for gamma, expected in [(0.899, [0, 1, 2, 5]), (0.979, [0, 1, 2, 3, 5]),
                            (1.0, [0, 1, 2, 3, 4, 5])]:
        lists, counts = ref.select(_log_masses_from_shares(shares), seq_lens, gamma=gamma)
        assert lists[0, 0, : counts[0, 0]].tolist() == expected


def test_forced_pages_count_once_and_ties_go_together():
    shares = [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]
    seq_lens = torch.tensor([6 * PAGE_SIZE - 10], dtype=torch.int32)
    lists, counts = ref.select(_log_masses_from_shares(shares), seq_lens, gamma=0.65)
    assert lists[0, 0, : counts[0, 0]].tolist() == [0, 1, 2, 3, 4, 5]  # tau = 0.1, all tied
    lists, counts = ref.select(_log_masses_from_shares(shares), seq_lens, gamma=0.55)
    assert lists[0, 0, : counts[0, 0]].tolist() == [0, 5]  # sink + current already reach it


def test_top_k_keeps_k_pages_with_ties_by_position():
    shares = [0.3, 0.1, 0.2, 0.1, 0.1, 0.2]
    seq_lens = torch.tensor([6 * PAGE_SIZE], dtype=torch.int32)
    lists, counts = ref.select(_log_masses_from_shares(shares), seq_lens, top_k=4)
    assert lists[0, 0, : counts[0, 0]].tolist() == [0, 1, 2, 5]
    lists, counts = ref.select(_log_masses_from_shares(shares), seq_lens, top_k=10)
    assert counts[0, 0] == 6


def test_work_split_paper_example():
    # section 3.3: J = 4, C = 2, rows of 8, 3, 5 and 2 pages use 4, 2, 3 and 1 programs
    config = MoiraConfig(chunk_pages=2, min_chunks_per_row=4, min_programs=1)
    chunks_per_row, chunk_pages, num_chunks = ref.work_split(
        torch.tensor([8, 3, 5, 2, 0]), 5, config, even=False)
    assert chunks_per_row == 4
    assert num_chunks.tolist() == [4, 2, 3, 1, 1]
    assert chunk_pages.tolist() == [2, 2, 2, 2, 2]


def test_even_chunks_keep_the_programs_and_shorten_the_longest():
    """Attend's ``EVEN_CHUNKS`` option: Eq. (4)'s chunk count per row, every chunk but the last
    of ceil(n / m) pages and the last at most m - 1 shorter, none longer than Eq. (4)'s; e.g.
    28 pages at C = 24: 14 + 14, not 24 + 4."""
    config = MoiraConfig(chunk_pages=24, min_chunks_per_row=32, min_programs=4096)
    counts = torch.arange(0, 3000)
    _, paper_chunk, paper_chunks = ref.work_split(counts, 256, config, even=False)
    _, chunk, chunks = ref.work_split(counts, 256, config, even=True)
    assert (chunks == paper_chunks).all()
    assert (chunk <= paper_chunk).all()
    last = counts - (chunks - 1) * chunk  # the last chunk's pages
    busy = counts > 0
    assert ((last[busy] >= 1) & (last[busy] <= chunk[busy])
            & (chunk[busy] - last[busy] < chunks[busy])).all()
    assert (chunk[28], chunks[28], chunk[54], chunks[54]) == (14, 2, 18, 3)


def test_capping_j_at_the_block_table_changes_no_chunk():
    config = MoiraConfig(chunk_pages=3, min_chunks_per_row=40, min_programs=1)
    counts = torch.arange(0, 61)
    uncapped = ref.work_split(counts, 61, config)
    capped = ref.work_split(counts, 61, config, max_pages=60)
    assert capped[0] == 20 < uncapped[0]
    assert torch.equal(capped[1], uncapped[1]) and torch.equal(capped[2], uncapped[2])


def test_short_rows_of_a_small_step_are_cut_finer():
    """MoiraConfig.step_programs T: in a step of 32 rows (4 requests) a row of n pages gets a
    floor of min(C, max(2, ceil(n * 32 / T))) instead of C = 24; long rows and steps of T rows
    or more keep Eq. (4)'s chunk count."""
    config, eq4 = MoiraConfig(), MoiraConfig(step_programs=0)
    assert config.step_programs == 256
    counts = torch.tensor([2, 32, 54, 300, 2048])
    _, chunk, chunks = ref.work_split(counts, 32, config, max_pages=2048)
    assert chunk.tolist() == [2, 4, 7, 24, 24] and chunks.tolist() == [1, 8, 8, 13, 86]
    _, chunk, chunks = ref.work_split(counts, 32, config.replace(step_programs=128),
                                      max_pages=2048)
    assert chunk.tolist() == [2, 8, 14, 24, 24] and chunks.tolist() == [1, 4, 4, 13, 86]
    _, chunk, chunks = ref.work_split(counts, 32, eq4, max_pages=2048)
    assert chunk.tolist() == [24] * 5 and chunks.tolist() == [1, 2, 3, 13, 86]
    counts = torch.arange(0, 3000)
    for rows in (256, 512):
        assert torch.equal(ref.work_split(counts, rows, config)[2],
                           ref.work_split(counts, rows, eq4)[2])
    # J's cap at the block table's width removes no chunk of the short-row floor either
    for rows, width in ((8, 133), (16, 60), (3, 61)):
        counts = torch.arange(0, width + 1)
        uncapped, capped = ref.work_split(counts, rows, config), ref.work_split(
            counts, rows, config, max_pages=width)
        assert torch.equal(capped[1], uncapped[1]) and torch.equal(capped[2], uncapped[2])


def test_work_split_covers_every_page_once():
    config = MoiraConfig(chunk_pages=3, min_chunks_per_row=5, min_programs=1)
    counts = torch.arange(0, 200)
    chunks_per_row, chunk_pages, num_chunks = ref.work_split(counts, 200, config)
    assert (num_chunks <= chunks_per_row).all()
    assert ((num_chunks - 1) * chunk_pages < counts.clamp_min(1)).all()  # no empty chunk
    assert (num_chunks * chunk_pages >= counts).all()


def test_merge_of_splits_equals_whole_attention():
    scores, values = torch.randn(3, 4, 50), torch.randn(3, 50, 8)  # [G, tokens], [.., D]
    whole = torch.softmax(scores, -1) @ values
    cuts = [0, 7, 7, 30, 50]  # includes an empty split
    parts, lses = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        piece = scores[..., lo:hi]
        lses.append(torch.logsumexp(piece, -1) if hi > lo else torch.full(piece.shape[:-1],
                                                                           -math.inf))
        parts.append(torch.softmax(piece, -1) @ values[:, lo:hi] if hi > lo
                     else torch.full((3, 4, 8), float("nan")))
    out, lse = ref.merge(torch.stack(parts, -3), torch.stack(lses, -2))
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_merge_all_empty_gives_zeros():
    out, lse = ref.merge(torch.full((2, 3, 5, 8), float("nan")),
                         torch.full((2, 3, 5), -math.inf))
    assert (out == 0).all() and (lse == -math.inf).all()


def _random_step(seq_lens, num_kv_heads=2, group=3, head_dim=64):
    num_pages = 64
    keys = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    values = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    table = torch.randperm(num_pages)[: len(seq_lens) * 8].view(len(seq_lens), 8).int()
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim)
    return query, keys, values, table, torch.tensor(seq_lens, dtype=torch.int32)


def test_gamma_one_is_dense_attention():
    query, keys, values, table, seq_lens = _random_step([1, 64, 65, 300, 512])
    summaries = ref.summarize(keys, table, seq_lens)
    out, lists, counts = ref.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                           gamma=1.0, return_pages=True)
    assert counts.tolist() == [[1, 1], [1, 1], [2, 2], [5, 5], [8, 8]]
    torch.testing.assert_close(out, ref.dense_attention(query, keys, values, table, seq_lens))


def test_estimate_is_exact_on_constant_pages_and_on_forced_pages():
    # a page of identical keys has zero variance, so mvar is exact there
    query, keys, values, table, seq_lens = _random_step([5 * PAGE_SIZE + 3])
    keys[table[0, 2]] = keys[table[0, 2], :1]
    summaries = ref.summarize(keys, table, seq_lens)
    est = ref.estimate(query, keys, summaries, table, seq_lens)
    exact = ref.exact_log_masses(query, keys, table, seq_lens)
    torch.testing.assert_close(est[..., [0, 2, 5]], exact[..., [0, 2, 5]])
    assert (est[..., 6:] == -math.inf).all()


def test_exact_log_masses_are_each_pages_log_sum_exp():
    query, keys, values, table, seq_lens = _random_step([PAGE_SIZE * 3 + 17, 1, PAGE_SIZE * 2])
    exact = ref.exact_log_masses(query, keys, table, seq_lens)
    scale = ref.default_scale(query.shape[-1])
    group = query.shape[1] // keys.shape[2]
    for b, seq_len in enumerate(seq_lens.tolist()):
        for page in range(-(-seq_len // PAGE_SIZE)):
            tokens = min(PAGE_SIZE, seq_len - page * PAGE_SIZE)
            page_keys = keys[table[b, page], :tokens].float()  # [tokens, Hkv, D]
            for head in range(query.shape[1]):
                logits = page_keys[:, head // group] @ query[b, head].float() * scale
                torch.testing.assert_close(exact[b, head // group, head % group, page],
                                           torch.logsumexp(logits, 0))
        assert (exact[b, ..., -(-seq_len // PAGE_SIZE):] == -math.inf).all()


def test_oracle_coverage_is_minimal():
    query, keys, values, table, seq_lens = _random_step([8 * PAGE_SIZE])
    query *= 4  # peaked attention
    lists, counts = ref.oracle_coverage(query, keys, table, seq_lens, 0.9)
    shares = ref.group_shares(ref.exact_log_masses(query, keys, table, seq_lens))
    for h in range(2):
        kept = shares[0, h, lists[0, h, : counts[0, h]].long()]
        assert kept.sum() >= 0.9
        assert kept.sum() - kept.min() < 0.9  # one page fewer would not reach gamma


def test_summarize_is_mean_and_population_variance():
    query, keys, values, table, seq_lens = _random_step([130])
    summaries = ref.summarize(keys, table, seq_lens)
    page = keys[table[0, 1]]
    torch.testing.assert_close(summaries[table[0, 1], :, 0], page.mean(0))
    torch.testing.assert_close(summaries[table[0, 1], :, 1], page.var(0, unbiased=False))
    assert (summaries[table[0, 2]] == 0).all()  # the partial page is untouched
