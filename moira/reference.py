"""The executable spec: every stage of Moira in plain float32 PyTorch.

Each function here is the definition its Triton kernel is tested against; it favours clarity
over speed (Python loops over rows, sorting where the kernels bisect). Shapes and layouts are
those of the public API (see ``moira.decode``):

- ``query`` ``[batch, num_heads, head_dim]``; query head ``h * G + g`` belongs to KV head ``h``.
- ``key_cache`` / ``value_cache`` ``[num_pages, 64, num_kv_heads, head_dim]``.
- ``block_table`` ``[batch, max_pages_per_seq]`` physical page ids; ``seq_lens`` ``[batch]``
  tokens in the cache, the current token included; 0 or negative: a padded row (no pages,
  output zeros).
- A *row* is one (request, KV head) pair; its pages are the logical pages
  ``0 .. ceil(seq_len / 64) - 1``: page 0 is the sink, the last one the current page.
- ``page_lists`` ``[batch, num_kv_heads, max_pages]`` logical page indices, the first
  ``page_counts[b, h]`` entries valid; ``page_counts`` ``[batch, num_kv_heads]``.
"""

from __future__ import annotations

import math

import torch

from .config import ESTIMATOR_BITS, PAGE_SIZE, MoiraConfig, summary_rows


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def num_pages(seq_len: int, max_pages: int) -> int:
    """Pages of a row: ceil(seq_len / 64), at most the block table's width; 0 for a padded row
    (``seq_len`` 0 or negative)."""
    return max(0, min(-(-int(seq_len) // PAGE_SIZE), max_pages))


def _grouped_query(query, b, num_kv_heads, scale):
    """Row queries of request b, scaled: ``[num_kv_heads, G, head_dim]`` float32."""
    _, num_heads, head_dim = query.shape
    return query[b].float().view(num_kv_heads, num_heads // num_kv_heads, head_dim) * scale


# --------------------------------------------------------------------------------------------
# The cache write of a decode token (sparse_decode's new_keys / new_values / slot_mapping)
# --------------------------------------------------------------------------------------------


def write_tokens(key_cache, value_cache, new_keys, new_values, slot_mapping):
    """Request ``b``'s key and value (``new_keys[b]``, ``[num_kv_heads, head_dim]``) into slot
    ``slot_mapping[b]`` = page * 64 + offset of the ``[num_pages, 64, num_kv_heads, head_dim]``
    caches, for ``b`` below both lengths; negative slots (vLLM's padding) are skipped. In
    place; returns the caches."""
    for b, slot in enumerate(slot_mapping.tolist()[:new_keys.shape[0]]):
        if slot >= 0:
            key_cache[slot // PAGE_SIZE, slot % PAGE_SIZE] = new_keys[b]
            value_cache[slot // PAGE_SIZE, slot % PAGE_SIZE] = new_values[b]
    return key_cache, value_cache


# --------------------------------------------------------------------------------------------
# Page summaries (section 3.1)
# --------------------------------------------------------------------------------------------


def quantize_page(keys, bits, dtype):
    """Codes of a full page's keys ``[..., 64, kv_heads, D]`` at ``bits`` bits per channel.

    The page's per-channel min ``lo`` and max ``hi`` are rounded to the summaries' ``dtype``
    first (they are what is stored; a NaN key makes its channel's ``lo`` NaN, and so the
    page's estimate, which Select then keeps); ``code = floor((k - lo) / step + 1/2)`` clamped to
    ``[0, 2**bits - 1]``, ``step = (hi - lo) / (2**bits - 1)`` (0 where ``hi == lo``).
    Returns ``(lo, hi, codes)``: ``[..., kv_heads, D]`` float32 twice, ``keys``' shape int64.
    """
    levels = 2**bits - 1
    lo = keys.amin(dim=-3).to(dtype).float()  # NaN in a channel holding a NaN key
    hi = keys.nan_to_num(nan=-math.inf).amax(dim=-3).to(dtype).float()
    step = ((hi - lo) / levels).unsqueeze(-3)
    scaled = torch.where(step > 0, (keys - lo.unsqueeze(-3)) / torch.where(step > 0, step, 1.0),
                         0.0)
    codes = torch.floor(scaled + 0.5).clamp(0, levels).long()
    return lo, hi, codes


def pack_codes(codes, bits):
    """``[..., 64, kv_heads, D]`` codes -> ``[..., kv_heads, 64 * D * bits / 8]`` uint8 (the
    layout of ``config.summary_rows``: byte j of a token holds channels j + s * D * bits / 8)."""
    *pages, tokens, num_kv_heads, head_dim = codes.shape
    width = head_dim * bits // 8  # bytes per token
    planes = codes.reshape(*pages, tokens, num_kv_heads, 8 // bits, width)
    packed = sum(planes[..., s, :] << (s * bits) for s in range(8 // bits))
    return packed.to(torch.uint8).transpose(-3, -2).reshape(*pages, num_kv_heads,
                                                            tokens * width)


def unpack_codes(packed, bits, head_dim):
    """Inverse of ``pack_codes``: ``[..., 64 * D * bits / 8]`` uint8 -> ``[..., 64, D]``."""
    width = head_dim * bits // 8
    data = packed.long().view(*packed.shape[:-1], PAGE_SIZE, 1, width)
    shifts = torch.arange(0, 8, bits, device=packed.device).view(-1, 1)
    return ((data >> shifts) & (2**bits - 1)).reshape(*packed.shape[:-1], PAGE_SIZE, head_dim)


def code_bytes(summaries):
    """The code bytes of ``int2`` / ``int4`` summaries ``[pages, kv_heads, rows, D]``:
    ``[pages, kv_heads, (rows - 2) * D * itemsize]`` uint8 (rows 2 onward, byte by byte)."""
    pages, num_kv_heads, rows, head_dim = summaries.shape
    raw = summaries.contiguous().view(torch.uint8)
    return raw.view(pages, num_kv_heads, rows, -1)[:, :, 2:].reshape(pages, num_kv_heads, -1)


def summarize(key_cache, block_table, seq_lens, summaries=None, estimator="mvar"):
    """The summary of every full page, for ``estimator`` (``config.summary_rows``).

    ``"mvar"``: per-channel mean and population variance of the page's 64 keys (rows 0, 1).
    ``"int2"`` / ``"int4"``: per-channel min and max (rows 0, 1), then every key's codes
    (``quantize_page``) packed as bytes.

    Returns ``summaries`` ``[num_pages, num_kv_heads, rows, head_dim]``, float32 unless a
    tensor is passed in. Pages that no row fills are untouched.
    """
    total_pages, _, num_kv_heads, head_dim = key_cache.shape
    bits = ESTIMATOR_BITS[estimator]
    if summaries is None:
        summaries = torch.zeros(total_pages, num_kv_heads, summary_rows(estimator, 4), head_dim,
                                dtype=torch.float32, device=key_cache.device)
    for b in range(block_table.shape[0]):
        full_pages = min(int(seq_lens[b]) // PAGE_SIZE, block_table.shape[1])
        if full_pages == 0:
            continue
        pages = block_table[b, :full_pages].long()
        keys = key_cache[pages].float()  # [pages, 64, num_kv_heads, head_dim]
        if bits == 0:
            summaries[pages, :, 0] = keys.mean(dim=1).to(summaries.dtype)
            summaries[pages, :, 1] = keys.var(dim=1, unbiased=False).to(summaries.dtype)
            continue
        lo, hi, codes = quantize_page(keys, bits, summaries.dtype)
        summaries[pages, :, 0] = lo.to(summaries.dtype)
        summaries[pages, :, 1] = hi.to(summaries.dtype)
        raw = summaries.view(torch.uint8).view(total_pages, num_kv_heads, -1)
        raw[pages, :, 2 * head_dim * summaries.element_size():] = pack_codes(codes, bits)
    return summaries


def dequantized_keys(summaries, physical, bits):
    """The keys of pages ``physical`` as their codes give them: ``[pages, 64, kv_heads, D]``
    float32, ``lo + code * step`` from ``int2`` / ``int4`` summaries."""
    head_dim = summaries.shape[-1]
    lo = summaries[physical, :, 0].float()[:, None]  # [pages, 1, Hkv, D]
    hi = summaries[physical, :, 1].float()[:, None]
    codes = unpack_codes(code_bytes(summaries[physical]), bits, head_dim)  # [pages, Hkv, 64, D]
    return lo + codes.transpose(1, 2).float() * (hi - lo) / (2**bits - 1)


# --------------------------------------------------------------------------------------------
# Estimate (Eq. 2) and the exact page masses
# --------------------------------------------------------------------------------------------


def _page_keys(key_cache, block_table, seq_len, b, page):
    """Keys of logical page ``page`` of request b up to seq_len: ``[tokens, kv_heads, D]``."""
    tokens = min(PAGE_SIZE, int(seq_len) - page * PAGE_SIZE)
    return key_cache[int(block_table[b, page]), :tokens].float()


def _exact_page_log_mass(query_rows, keys):
    """log sum_k exp(s q_g . k) over a page's keys, for every KV head and query head.

    query_rows ``[kv_heads, G, D]`` (already scaled), keys ``[tokens, kv_heads, D]``.
    Returns ``[kv_heads, G]``.
    """
    logits = torch.einsum("hgd,thd->hgt", query_rows, keys)
    return torch.logsumexp(logits, dim=-1)


def estimate(query, key_cache, summaries, block_table, seq_lens, scale=None, estimator="mvar"):
    """Log-mass of every page for every query head, from the summaries, exact for the sink
    (page 0) and the current page.

    ``"mvar"`` (Eq. 2): log m_{g,P} = s q_g . mu_P + 1/2 (s q_g)^2 . sigma_P^2 + log 64.
    ``"int2"`` / ``"int4"``: log m_{g,P} = log sum_t exp(s q_g . k~_t), k~_t the page's keys
    as their codes give them (``dequantized_keys``).

    Returns ``log_masses`` ``[batch, num_kv_heads, G, max_pages]`` float32, ``-inf`` past each
    row's pages.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_pages = block_table.shape[1]
    scale = default_scale(head_dim) if scale is None else scale
    bits = ESTIMATOR_BITS[estimator]
    log_masses = torch.full(
        (batch, num_kv_heads, group, max_pages), -math.inf, device=query.device
    )
    for b in range(batch):
        pages = num_pages(seq_lens[b], max_pages)
        if pages == 0:
            continue
        q = _grouped_query(query, b, num_kv_heads, scale)  # [Hkv, G, D]
        physical = block_table[b, :pages].long()
        if bits:
            keys = dequantized_keys(summaries, physical, bits)  # [pages, 64, Hkv, D]
            est = torch.logsumexp(torch.einsum("hgd,pthd->hgpt", q, keys), dim=-1)
        else:
            mean = summaries[physical, :, 0].float()  # [pages, Hkv, D]
            var = summaries[physical, :, 1].float()
            est = (
                torch.einsum("hgd,phd->hgp", q, mean)
                + 0.5 * torch.einsum("hgd,phd->hgp", q * q, var)
                + math.log(PAGE_SIZE)
            )
        for page in {0, pages - 1}:
            keys = _page_keys(key_cache, block_table, seq_lens[b], b, page)
            est[:, :, page] = _exact_page_log_mass(q, keys)
        log_masses[b, :, :, :pages] = est
    return log_masses


def exact_log_masses(query, key_cache, block_table, seq_lens, scale=None):
    """Exact log-mass of every page, same shape as ``estimate`` (the oracle of Eq. 1)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    max_pages = block_table.shape[1]
    scale = default_scale(head_dim) if scale is None else scale
    log_masses = torch.full(
        (batch, num_kv_heads, num_heads // num_kv_heads, max_pages), -math.inf,
        device=query.device,
    )
    for b in range(batch):
        pages = num_pages(seq_lens[b], max_pages)
        if pages == 0:
            continue
        q = _grouped_query(query, b, num_kv_heads, scale)
        keys = key_cache[block_table[b, :pages].long()].float()  # [pages, 64, Hkv, D]
        logits = torch.einsum("hgd,pthd->hgpt", q, keys)
        position = torch.arange(pages * PAGE_SIZE, device=query.device).view(pages, PAGE_SIZE)
        logits = logits.masked_fill(position >= int(seq_lens[b]), -math.inf)
        log_masses[b, :, :, :pages] = torch.logsumexp(logits, dim=-1)
    return log_masses


def _unknown(log_masses):
    """Estimates that say nothing of a mass: NaN or +inf (-inf is a mass of zero)."""
    return torch.isnan(log_masses) | torch.isposinf(log_masses)


def unreadable(log_masses):
    """Pages whose estimate is NaN or +inf for some query head of the group (non-finite keys,
    summaries or queries): ``[batch, num_kv_heads, max_pages]`` bool. Select keeps them in
    every mode, as it cannot tell their mass."""
    return _unknown(log_masses).any(dim=2)


def group_shares(log_masses):
    """Attention share of each page, softmax over pages per query head, averaged over the G
    query heads of the group: ``[batch, num_kv_heads, max_pages]`` (0 past a row's pages).
    An estimate that is NaN or +inf takes no part in its head's softmax, and an
    ``unreadable`` page's share is 0."""
    unknown = _unknown(log_masses)
    shares = torch.softmax(log_masses.float().masked_fill(unknown, -math.inf), dim=-1)
    shares = torch.nan_to_num(shares, nan=0.0).mean(dim=2)  # a head with nothing readable: 0
    return shares.masked_fill(unknown.any(dim=2), 0.0)


# --------------------------------------------------------------------------------------------
# Select: the coverage rule (Eq. 3) and fixed-K
# --------------------------------------------------------------------------------------------


def coverage_threshold(shares, gamma):
    """tau of Eq. (3) for one row's shares ``[pages]``, and the number of middle pages it keeps.

    The middle pages (all but the sink and the current page) are kept in decreasing share until
    their sum reaches gamma minus the two forced pages' shares; every page at least as large as
    the last one kept is kept (the rule is a threshold, so ties go in together).
    Returns ``(tau, target)``; ``tau = inf`` keeps no middle page, ``tau = -inf`` keeps all.
    """
    middle = shares[1:-1]
    target = gamma - float(shares[0]) - float(shares[-1])
    if gamma >= 1.0:
        return -math.inf, target
    if middle.numel() == 0 or target <= 0:
        return math.inf, target
    ordered = torch.sort(middle, descending=True).values
    # float64 sums: over thousands of pages float32 rounding would blur which page reaches it
    reached = torch.searchsorted(torch.cumsum(ordered.double(), 0),
                                 torch.tensor([target], dtype=torch.float64))
    last = min(int(reached), middle.numel() - 1)  # rounding: never past the last page
    return float(ordered[last]), target


def _pack(shares, seq_lens, choose):
    """Apply ``choose(row_shares, b, h) -> kept pages`` to every row; pack the results as
    ``(page_lists [batch, kv_heads, max_pages] int32, -1 past the count; page_counts)``."""
    batch, num_kv_heads, max_pages = shares.shape
    page_lists = torch.full((batch, num_kv_heads, max_pages), -1, dtype=torch.int32)
    page_counts = torch.zeros((batch, num_kv_heads), dtype=torch.int32)
    for b in range(batch):
        pages = num_pages(seq_lens[b], max_pages)
        for h in range(num_kv_heads):
            kept = choose(shares[b, h, :pages].cpu(), b, h) if pages else []
            page_lists[b, h, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
            page_counts[b, h] = len(kept)
    return page_lists.to(shares.device), page_counts.to(shares.device)


def fraction_counts(keep_fractions, seq_lens, max_pages):
    """Fraction mode's per-row counts ``[batch, num_kv_heads]``: ``max(2, floor(f * pages +
    0.5))`` for a row of ``pages`` pages, f from ``keep_fractions`` ``[num_kv_heads]`` (per KV
    head) or ``[batch, num_kv_heads]``."""
    pages = torch.tensor([num_pages(n, max_pages) for n in seq_lens.tolist()],
                         dtype=torch.float32)
    fractions = keep_fractions.float().cpu()
    fractions = fractions[None, :] if fractions.dim() == 1 else fractions
    counts = torch.floor(fractions * pages[:, None] + 0.5)
    return counts.clamp(min=2).to(torch.int32)


def select(log_masses, seq_lens, *, gamma=0.98, top_k=None, keep_fractions=None,
           dense_below_pages=0):
    """The pages each row keeps: coverage rule (default; ``gamma`` a number, or per-row
    targets ``[num_kv_heads]`` or ``[batch, num_kv_heads]``) or, with ``top_k``, the ``top_k``
    largest (sink and current page included; rows of at most ``top_k`` pages keep all; ties
    broken by lower page index). A middle page whose estimate is NaN or +inf (``unreadable``)
    is kept under the coverage rule and ranks first under ``top_k``, never dropped unseen.
    ``top_k`` is an int or a ``[batch, num_kv_heads]`` tensor of per-row counts;
    ``keep_fractions`` (``[num_kv_heads]`` or ``[batch, num_kv_heads]``) sets them from each
    row's length (``fraction_counts``). Rows of at most ``dense_below_pages``
    pages keep every page, in every mode.

    Returns ``(page_lists, page_counts)``: ``[batch, num_kv_heads, max_pages]`` int32 logical
    pages, sink first, current page last, the middle in increasing order, ``-1`` past the count;
    ``[batch, num_kv_heads]`` int32.
    """

    def choose(row, b, h):
        pages = len(row)
        if pages <= max(2, dense_below_pages):
            return list(range(pages))
        bad = unknown[b, h, 1:pages - 1]  # middle pages whose estimate is not finite
        if top_k is not None:
            count = int(top_k[b, h]) if torch.is_tensor(top_k) else top_k
            # unreadable pages rank above every share (in page order among themselves)
            order = torch.sort(torch.where(bad, 2.0, row[1:-1]), descending=True,
                               stable=True).indices
            chosen = sorted((order[: max(count - 2, 0)] + 1).tolist())
        else:
            target = gamma
            if torch.is_tensor(gamma):
                target = float(gamma[h] if gamma.dim() == 1 else gamma[b, h])
            tau, _ = coverage_threshold(row, target)
            chosen = (torch.nonzero((row[1:-1] >= tau) | bad).flatten() + 1).tolist()
        return [0] + chosen + [pages - 1]

    if keep_fractions is not None:
        top_k = fraction_counts(keep_fractions, seq_lens, log_masses.shape[-1])
    unknown = unreadable(log_masses).cpu()
    return _pack(group_shares(log_masses), seq_lens, choose)


def oracle_coverage(query, key_cache, block_table, seq_lens, gamma, scale=None):
    """The oracle coverage set C*(gamma) of Eq. (1): per row, the fewest pages whose exact
    group-mean attention share reaches gamma (no forced pages). Same return format as
    ``select`` (pages in increasing order)."""

    def choose(row, b, h):
        order = torch.sort(row, descending=True, stable=True).indices
        needed = int(torch.searchsorted(torch.cumsum(row[order].double(), 0),
                                        torch.tensor([gamma], dtype=torch.float64)))
        return sorted(order[: min(needed + 1, len(row))].tolist())

    shares = group_shares(exact_log_masses(query, key_cache, block_table, seq_lens, scale))
    return _pack(shares, seq_lens, choose)


# --------------------------------------------------------------------------------------------
# Attend: the self-planning work split (Eq. 4), attention over page lists, the LSE merge
# --------------------------------------------------------------------------------------------


def imposed_fractions(seq_lens, log_tokens, tables):
    """Read fractions imposed for timing runs (random weights say nothing about which pages a
    trained model needs, so speed is measured at stated read fractions): for each request, the
    per-(layer, KV head) table ``tables[k]`` (``[knots, layers, heads]``) interpolated linearly
    in log context length between the knots ``log_tokens`` (increasing), clamped at the first
    and last knot. Returns float32 ``[layers, batch, heads]``."""
    x = torch.log(seq_lens.float().clamp(min=1))
    knots = tables.shape[0]
    upper = torch.searchsorted(log_tokens, x).clamp(min=1).clamp(max=knots - 1)
    lower = (upper - 1).clamp(min=0)
    span = log_tokens[upper] - log_tokens[lower]  # 0 only with a single knot: alpha 0
    alpha = ((x - log_tokens[lower]) / torch.where(span > 0, span, 1.0)).clamp(0, 1)
    alpha = torch.where(span > 0, alpha, 0.0)[:, None, None]
    fractions = tables[lower] * (1 - alpha) + tables[upper] * alpha
    return fractions.permute(1, 0, 2)


def work_split(page_counts, num_rows, config=MoiraConfig(), max_pages=None, even=False):
    """Eq. (4) as a pure function of the row lengths.

    Attend launches J = max(N_J, ceil(N_T / num_rows)) programs per row (at most
    ``config.max_chunks_per_row``, and ceil(max_pages / C) when the block table's width
    ``max_pages`` is given: ``MoiraConfig.chunks_per_row``); program j of a
    row of n pages processes pages ``[j c, min((j + 1) c, n))`` with c = max(C, ceil(n / J)) (C
    from ``config.chunk_floor(num_rows)``), and exits if ``j >= m = ceil(n / c)``. With
    ``even`` (Attend's ``EVEN_CHUNKS``), the m chunks are made equal: c' = ceil(n / m), and m'
    = ceil(n / c') <= m chunks (as many programs, none longer). Program 0 always runs (it
    writes the output of an empty row). With ``config.step_programs`` T, C of a row of n
    pages is min(C, max(2, ceil(n * num_rows / T))). Returns ``(J, chunk_pages,
    num_chunks)``, the last two shaped like ``page_counts``.
    """
    chunks_per_row = config.chunks_per_row(num_rows, max_pages)
    counts = page_counts.long()
    floor = torch.full_like(counts, config.chunk_floor(num_rows))
    if config.step_programs:  # a short row of a small step: about T programs in all
        floor = torch.minimum(floor, torch.clamp(-(-counts * num_rows // config.step_programs),
                                                 min=2))
    chunk_pages = torch.maximum(-(-counts // chunks_per_row), floor)
    if even:
        chunks = torch.clamp(-(-counts // chunk_pages), min=1)
        chunk_pages = torch.clamp(-(-counts // chunks), min=1)
    num_chunks = torch.clamp(-(-counts // chunk_pages), min=1)
    return chunks_per_row, chunk_pages, num_chunks


def attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts, *,
           scale=None, dtype=torch.float32):
    """Exact attention of each row's G query heads over the tokens of its listed pages (tokens
    at or past ``seq_len`` masked; entries outside the block table's ``[0, max_pages)`` read
    nothing). A row with no page outputs zeros.

    ``dtype`` is the compute dtype: float32 is the spec; bfloat16 gives the low-precision
    baseline that tolerances are measured against. Returns ``[batch, num_heads, head_dim]``.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = default_scale(head_dim) if scale is None else scale
    out = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=query.device)
    offsets = torch.arange(PAGE_SIZE, device=query.device)
    for b in range(batch):
        for h in range(num_kv_heads):
            pages = page_lists[b, h, : int(page_counts[b, h])].long()
            pages = pages[(pages >= 0) & (pages < block_table.shape[1])]
            tokens = (pages[:, None] * PAGE_SIZE + offsets).flatten()
            valid = tokens < int(seq_lens[b])
            physical = block_table[b, pages].long()
            keys = key_cache[physical, :, h].reshape(-1, head_dim)[valid].to(dtype)
            values = value_cache[physical, :, h].reshape(-1, head_dim)[valid].to(dtype)
            if keys.shape[0] == 0:
                continue
            q = query[b, h * group : (h + 1) * group].to(dtype)
            probs = torch.softmax((q @ keys.T).float() * scale, dim=-1)
            out[b, h * group : (h + 1) * group] = probs.to(dtype) @ values
    return out


def merge(partial_out, partial_lse):
    """Log-sum-exp combination of split-KV partials.

    ``partial_out`` ``[..., splits, G, D]`` (each split's normalized output) and
    ``partial_lse`` ``[..., splits, G]`` (natural-log LSE, ``-inf`` for an empty split).
    Returns ``(out [..., G, D], lse [..., G])``; all-empty rows give zeros and ``-inf``.
    """
    lse = torch.logsumexp(partial_lse, dim=-2)
    weights = torch.exp(partial_lse - lse.unsqueeze(-2)).nan_to_num(nan=0.0).unsqueeze(-1)
    out = torch.where(weights > 0, weights * partial_out, 0.0).sum(dim=-3)
    return out, lse


def dense_attention(query, key_cache, value_cache, block_table, seq_lens, *, scale=None,
                    dtype=torch.float32):
    """Attention over every page of every row (``attend`` with full lists)."""
    batch, max_pages = block_table.shape
    num_kv_heads = key_cache.shape[2]
    page_lists = torch.arange(max_pages, dtype=torch.int32, device=query.device)
    page_lists = page_lists.expand(batch, num_kv_heads, max_pages)
    page_counts = torch.tensor(
        [[num_pages(seq_lens[b], max_pages)] * num_kv_heads for b in range(batch)],
        dtype=torch.int32, device=query.device,
    )
    return attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts,
                  scale=scale, dtype=dtype)


# --------------------------------------------------------------------------------------------
# The whole step
# --------------------------------------------------------------------------------------------


def sparse_decode(query, key_cache, value_cache, summaries, block_table, seq_lens, *,
                  gamma=None, top_k=None, keep_fractions=None, scale=None, return_pages=False,
                  config=None):
    """Estimate -> Select -> Attend in float32; same contract as ``moira.sparse_decode``."""
    config = config or MoiraConfig()
    gamma = config.gamma if gamma is None else gamma
    top_k = config.top_k if top_k is None else top_k
    log_masses = estimate(query, key_cache, summaries, block_table, seq_lens, scale,
                          config.estimator)
    page_lists, page_counts = select(log_masses, seq_lens, gamma=gamma, top_k=top_k,
                                     keep_fractions=keep_fractions)
    out = attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts,
                 scale=scale)
    return (out, page_lists, page_counts) if return_pages else out
