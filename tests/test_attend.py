import pytest
import torch
import triton
import triton.language as tl
from helpers import (DEVICE, SMALL_SPLIT, assert_attention_close, make_cache, make_query,
                     make_table, poisoned)

import moira
from moira import KernelOptions, MoiraConfig
from moira import reference as ref
from moira.kernels import launch
from moira.kernels import split as work_split
from moira.kernels.triton.attend import plan_row


def attend_with(config=SMALL_SPLIT, backend="triton", **tuning):
    """``config`` with Attend on ``backend`` and these ``attend.*`` tuning constants."""
    return config.replace(kernels=KernelOptions(
        attend=backend, tuning={f"attend.{name}": value for name, value in tuning.items()}))


def random_lists(seq_lens, num_kv_heads, width, fraction=0.5, shuffle=False):
    """Per-row random page subsets (any order), some empty, some full."""
    batch = len(seq_lens)
    page_lists = torch.full((batch, num_kv_heads, width), -1, dtype=torch.int32)
    page_counts = torch.zeros((batch, num_kv_heads), dtype=torch.int32)
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, width)
        for h in range(num_kv_heads):
            if (b + h) % 5 == 3:
                keep = torch.arange(0)  # an empty list
            elif (b + h) % 5 == 1:
                keep = torch.arange(pages)  # the whole row
            else:
                keep = torch.nonzero(torch.rand(pages) < fraction).flatten()
                if pages:
                    keep = torch.unique(torch.cat([keep, torch.tensor([pages - 1])]))
            if shuffle:
                keep = keep[torch.randperm(len(keep))]
            page_lists[b, h, : len(keep)] = keep.to(torch.int32)
            page_counts[b, h] = len(keep)
    return page_lists.to(DEVICE), page_counts.to(DEVICE)


def check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config,
                 scale=None):
    out = poisoned(*query.shape, dtype=query.dtype)
    moira.attend(query, keys, values, table, seq_lens, page_lists, page_counts, scale=scale,
                 config=config, out=out)
    args = [t.cpu() for t in (query, keys, values, table, seq_lens, page_lists, page_counts)]
    out_ref = ref.attend(*args, scale=scale)
    out_lowp = ref.attend(*args, scale=scale, dtype=query.dtype)
    assert_attention_close(out, out_ref, out_lowp)
    return out


def test_small_batch_scales_the_chunk_floor():
    """One request's rows, the floor scaled below chunk_pages (C = 8 from 16 rows, 2 here: 7
    chunks of 2 pages where C = 8 would make 2): Attend and Merge agree with the reference."""
    config = MoiraConfig(chunk_pages=8, floor_rows=16, min_chunks_per_row=16, min_programs=8)
    assert config.chunk_floor(2) == 2
    num_kv_heads, group, head_dim = 2, 4, 64
    keys, values = make_cache(40, num_kv_heads, head_dim)
    table, seq_lens = make_table([64 * 13 + 5], 40)
    query = make_query(1, num_kv_heads * group, head_dim)
    page_lists, page_counts = random_lists(seq_lens.cpu(), num_kv_heads, table.shape[1])
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config)


def test_the_ceiling_on_chunks_per_row_lengthens_a_long_rows_chunks():
    """One request with J held to 3 by ``max_chunks_per_row`` (N_T alone would give 32): its
    rows of 14 and 9 listed pages run in 3 chunks each, of 5 and 3 pages (C = 2 at 2 rows),
    not 7 and 5 of 2; Attend and Merge agree with the reference."""
    config = MoiraConfig(chunk_pages=8, floor_rows=16, min_chunks_per_row=2, min_programs=64,
                         max_chunks_per_row=3, step_programs=0)
    assert config.chunks_per_row(2) == 3
    assert config.replace(max_chunks_per_row=64).chunks_per_row(2) == 32
    num_kv_heads, group, head_dim = 2, 4, 64
    keys, values = make_cache(40, num_kv_heads, head_dim)
    table, seq_lens = make_table([64 * 13 + 5], 40)
    query = make_query(1, num_kv_heads * group, head_dim)
    page_lists = torch.full((1, num_kv_heads, table.shape[1]), -1, dtype=torch.int32)
    page_lists[0, 0, :14] = torch.arange(14, dtype=torch.int32)
    page_lists[0, 1, :9] = torch.tensor([0, 2, 3, 5, 8, 9, 11, 12, 13], dtype=torch.int32)
    page_counts = torch.tensor([[14, 9]], dtype=torch.int32)
    page_lists, page_counts = page_lists.to(DEVICE), page_counts.to(DEVICE)
    chunks_per_row, chunk, chunks = ref.work_split(page_counts.cpu().flatten(), 2, config,
                                                   max_pages=table.shape[1])
    assert chunks_per_row == 3 and chunk.tolist() == [5, 3] and chunks.tolist() == [3, 3]
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config)
    assert kernel_chunks(query, keys, values, table, seq_lens, page_lists, page_counts, config,
                         chunks_per_row) == [3, 3]


@pytest.mark.parametrize("chunk_floor", [1, 2, 3, 6, 24])
def test_short_row_pages_bounds_exactly_the_rows_the_floor_cuts_finer(chunk_floor):
    """``short_row_pages`` L: ``plan_row``'s floor, computed only for rows of n <= L pages
    (torch here; the kernel at the boundary: next test), equals the reference's
    min(C, max(2, ceil(n * rows / T))) for every n, rows and T, within int32."""
    counts = torch.arange(0, 24_001)
    for rows in (1, 2, 7, 8, 32, 64, 128, 255, 256, 512):
        for programs in (0, 1, 8, 128, 256, 1000):
            short = work_split.short_row_pages(chunk_floor, rows, programs)
            assert short < counts[-1]  # the boundary is inside the range tested
            kernel_floor = torch.where(counts <= short, torch.clamp(
                -(-counts * rows // max(programs, 1)), min=2), chunk_floor)
            expected = torch.full_like(counts, chunk_floor)
            if programs:
                expected = torch.minimum(expected, torch.clamp(-(-counts * rows // programs),
                                                               min=2))
            assert torch.equal(kernel_floor, expected), (rows, programs)
            # cdiv adds T - 1 to n * rows: at most C * T - 1, below 2**31 by MoiraConfig
            assert short < 0 or short * rows + programs - 1 <= chunk_floor * programs - 1


def test_short_rows_of_a_small_step_are_cut_finer():
    """The short-row floor (step_programs T = 8 over 2 rows: a row of 14 pages in chunks of 4,
    not C = 8): Attend and Merge agree with the reference on rows split more finely."""
    config = MoiraConfig(chunk_pages=8, floor_rows=1, min_chunks_per_row=16, min_programs=1,
                         step_programs=8)
    num_kv_heads, group, head_dim = 2, 4, 64
    keys, values = make_cache(40, num_kv_heads, head_dim)
    # a table wider than the row (as in an engine), so J's cap leaves more chunks than the
    # floor gives: the chunk count then depends on step_rows and T
    table, seq_lens = make_table([64 * 13 + 5], 40, extra_columns=26)
    query = make_query(1, num_kv_heads * group, head_dim)
    page_lists, page_counts = random_lists(seq_lens.cpu(), num_kv_heads, table.shape[1],
                                           fraction=0.7)
    counts = page_counts.cpu().flatten()
    chunks_per_row, _, finer = ref.work_split(counts, 2, config, max_pages=table.shape[1])
    assert (finer > ref.work_split(counts, 2, config.replace(step_programs=0))[2]).any()
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config)
    assert kernel_chunks(query, keys, values, table, seq_lens, page_lists, page_counts, config,
                         chunks_per_row) == [m if m > 1 else 0 for m in finer.tolist()]


def kernel_chunks(query, keys, values, table, seq_lens, page_lists, page_counts, config,
                  chunks_per_row):
    """The kernel's own split: per row, the chunks whose log-sum-exp it wrote (0 for a row it
    did not split)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    group, rows = num_heads // num_kv_heads, batch * num_kv_heads
    workspace = moira.DecodeWorkspace(batch, table.shape[1], num_heads, num_kv_heads, head_dim,
                                      device=DEVICE, config=config)
    workspace.partial_lse.fill_(float("nan"))
    moira.attend(query, keys, values, table, seq_lens, page_lists, page_counts,
                 workspace=workspace, out=poisoned(*query.shape, dtype=query.dtype))
    written = ~torch.isnan(workspace.partial_lse.cpu())
    # a kernel planning with another J would write slots past rows * J (or read as another
    # row's): nothing may lie there
    assert not written[rows * chunks_per_row * group:].any(), "partials past rows * J"
    written = written[:rows * chunks_per_row * group]
    return written.view(rows, chunks_per_row, group).all(-1).sum(-1).tolist()


@triton.jit
def _plan_probe(page_counts, chunk_out, chunks_out, stride_cb, stride_ch, chunk_floor,
                chunks_per_row, step_rows, step_programs, short_pages, num_kv_heads,
                EVEN: tl.constexpr):
    row = tl.program_id(0)
    b, head = row // num_kv_heads, row % num_kv_heads
    _, chunk, chunks = plan_row(page_counts, b, head, stride_cb, stride_ch, chunk_floor,
                                chunks_per_row, step_rows, step_programs, short_pages, EVEN)
    tl.store(chunk_out + row, chunk)
    tl.store(chunks_out + row, chunks)


def test_plan_row_is_the_reference_split_for_random_steps():
    """``plan_row`` (Attend's and Merge's plan) against ``reference.work_split`` on random
    steps: J and the floors binding, empty rows and all-empty steps, a planned batch larger
    than the launched one, page counts in a transposed view, both chunk rules."""
    generator = torch.Generator().manual_seed(30)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    for case in range(48):
        num_kv_heads, batch = pick(1, 2, 8), pick(1, 3, 9)
        rows, planned_rows = batch * num_kv_heads, batch * num_kv_heads * pick(1, 2)
        width = pick(8, 64, 2048, 32768)
        counts = torch.randint(0, width + 1, (batch, num_kv_heads), generator=generator)
        if case % 4 == 1:
            counts.zero_()
        elif case % 4 == 2:
            counts = torch.where(torch.rand(batch, num_kv_heads, generator=generator) < 0.5, 0,
                                 counts % 9)
        counts = counts.int().t().contiguous().t() if case % 2 else counts.int()
        config = MoiraConfig(chunk_pages=pick(1, 3, 24), floor_rows=pick(1, 32),
                             step_programs=pick(0, 8, 256),
                             min_chunks_per_row=pick(1, 32), min_programs=pick(1, 4096),
                             max_chunks_per_row=pick(32, 4096))
        floor = config.chunk_floor(planned_rows)
        chunks_per_row = config.chunks_per_row(planned_rows, width)
        short = work_split.short_row_pages(floor, planned_rows, config.step_programs)
        for even in (False, True):
            out = [torch.full((rows,), -1, dtype=torch.int32, device=DEVICE) for _ in range(2)]
            counts_dev = counts.to(DEVICE)
            _plan_probe[(rows,)](counts_dev, *out, *counts_dev.stride(), floor, chunks_per_row,
                                 planned_rows, config.step_programs, short, num_kv_heads,
                                 EVEN=even)
            chunk, chunks = (t.cpu() for t in out)
            _, ref_chunk, ref_chunks = ref.work_split(counts.flatten(), planned_rows, config,
                                                      max_pages=width, even=even)
            assert torch.equal(chunk, ref_chunk.int()), (case, even)
            assert torch.equal(chunks, ref_chunks.int()), (case, even)
            assert (chunks <= chunks_per_row).all()


def test_a_row_of_exactly_short_row_pages_gets_the_finer_floor():
    """With C = 8, T = 16 over 2 rows, short_row_pages is 56: a row of 56 listed pages gets the
    floor ceil(56 * 2 / 16) = 7 (8 chunks), one of 57 the floor C (8 chunks of up to 8); had
    the boundary been exclusive, 56 pages would make 7 chunks."""
    config = MoiraConfig(chunk_pages=8, floor_rows=1, min_chunks_per_row=16, min_programs=1,
                         step_programs=16)
    assert work_split.short_row_pages(8, 2, 16) == 56
    num_kv_heads, group, head_dim = 2, 4, 64
    keys, values = make_cache(80, num_kv_heads, head_dim)
    table, seq_lens = make_table([64 * 59 + 5], 80, extra_columns=10)
    query = make_query(1, num_kv_heads * group, head_dim)
    page_lists = torch.full((1, num_kv_heads, table.shape[1]), -1, dtype=torch.int32)
    page_lists[0, 0, :56] = torch.arange(56, dtype=torch.int32)
    page_lists[0, 1, :57] = torch.arange(57, dtype=torch.int32)
    page_counts = torch.tensor([[56, 57]], dtype=torch.int32)
    page_lists, page_counts = page_lists.to(DEVICE), page_counts.to(DEVICE)
    chunks_per_row, chunk, chunks = ref.work_split(page_counts.cpu().flatten(), 2, config,
                                                   max_pages=table.shape[1])
    assert chunk.tolist() == [7, 8] and chunks.tolist() == [8, 8]
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config)
    assert kernel_chunks(query, keys, values, table, seq_lens, page_lists, page_counts, config,
                         chunks_per_row) == [8, 8]


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "packed", "hnd"])
# "auto": the CUDA Attend on a GPU (bfloat16), Triton's kernel on the CPU
@pytest.mark.parametrize("implementation",
                         ["auto", pytest.param("triton", marks=pytest.mark.cuda)])
def test_attend_matches_reference(group, head_dim, layout, implementation):
    num_kv_heads, num_pages = 2, 120
    keys, values = make_cache(num_pages, num_kv_heads, head_dim, layout=layout)
    # one token, one full page, a partial second page, rows that split unevenly
    table, seq_lens = make_table([1, 64, 65, 64 * 7 + 3, 64 * 16, 64 * 11 + 63], num_pages)
    query = make_query(len(seq_lens), num_kv_heads * group, head_dim)
    page_lists, page_counts = random_lists(seq_lens.cpu(), num_kv_heads, table.shape[1],
                                           shuffle=layout == "hnd")
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts,
                 attend_with(backend=implementation))


def mixed_rows(num_kv_heads=2, group=4, head_dim=64):
    """Attend's inputs for rows of one token, a partial second page, chunks that split unevenly,
    full rows, shuffled lists: ``(query, keys, values, table, seq_lens, lists, counts)``."""
    keys, values = make_cache(120, num_kv_heads, head_dim)
    table, seq_lens = make_table([1, 65, 64 * 7 + 3, 64 * 16, 64 * 11 + 63], 120)
    query = make_query(len(seq_lens), num_kv_heads * group, head_dim)
    page_lists, page_counts = random_lists(seq_lens.cpu(), num_kv_heads, table.shape[1],
                                           shuffle=True)
    return query, keys, values, table, seq_lens, page_lists, page_counts


@pytest.mark.parametrize("pages_per_iter", [1, 2, 4])
def test_several_pages_per_tile(pages_per_iter):
    """The tuning knob that loads several listed pages per inner-loop tile: chunks whose length
    is not a multiple of it, partial last pages, empty and full rows."""
    check_attend(*mixed_rows(), attend_with(pages_per_iter=pages_per_iter))


def record_launches(monkeypatch):
    """The options of every kernel launch from here on (``launch.on``), in a list."""
    launched = []
    on = launch.on

    def recording_on(kernel, grid):
        run = on(kernel, grid)
        return lambda *args, **options: launched.append(options) or run(*args, **options)

    monkeypatch.setattr(launch, "on", recording_on)
    return launched


@pytest.mark.parametrize("schedule, pages_per_iter, stages, warps, group, head_dim",
                         [("rows", 1, 3, 4, 4, 128), ("rows", 1, 3, 8, 4, 128),
                          ("rows", 1, 4, 4, 1, 64), ("rows", 1, 3, 4, 7, 64),
                          ("rows", 2, 3, 4, 8, 128), ("rows", 4, 2, 4, 4, 64),
                          ("balanced", 1, 3, 4, 4, 64)])
def test_page_ids_loaded_a_tile_ahead(monkeypatch, schedule, pages_per_iter, stages, warps,
                                      group, head_dim):
    """``attend.page_ids_ahead`` (a tuning option): each tile's page ids come from the loop's
    previous iteration, and the lookahead past a chunk's last tile reads nothing; chunks of one
    to eight tiles, partial last pages, empty and full rows, G = 1 / 4 / 7 / 8, both schedules;
    the stages and warps of the arms of benchmarks/kernel_bench.py suite (the GPU builds differ by
    them, the interpreter not). The launch must have taken the option."""
    launched = record_launches(monkeypatch)
    # chunks of up to 8 pages (the floor not scaled down for this small step): several tiles
    # per chunk at every tile size here
    config = attend_with(SMALL_SPLIT.replace(chunk_pages=8, floor_rows=1, step_programs=0,
                                             schedule=schedule),
                         pages_per_iter=pages_per_iter, num_stages=stages, num_warps=warps,
                         page_ids_ahead=True)
    check_attend(*mixed_rows(group=group, head_dim=head_dim), config)
    assert any(options.get("PAGES_AHEAD") is True for options in launched)


def poison_unread_slots(keys, values, table, seq_lens):
    """NaN in every cache slot no row may read: pages outside the table and the tokens past
    each row's ``seq_len`` in its current page (a stale slot of an engine's cache)."""
    unread = torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)
    for row, seq_len in enumerate(seq_lens.tolist()):
        for page in range(min(-(-seq_len // 64), table.shape[1])):
            unread[table[row, page], : min(64, seq_len - 64 * page)] = False
    for cache in (keys, values):
        cache[unread] = float("nan")


@pytest.mark.parametrize("pages_per_iter, registers", [(1, 128), (1, 96)])
def test_register_ceiling(pages_per_iter, registers):
    """``attend.max_registers`` (a tuning option): builds under a register ceiling (96 spills 8
    bytes on sm_90) compute the same; the interpreter ignores the ceiling, the GPU run checks
    it."""
    check_attend(*mixed_rows(), attend_with(pages_per_iter=pages_per_iter,
                                            max_registers=registers))


@pytest.mark.parametrize("schedule", ["rows", "balanced"])
def test_fa3_normalizer_convention_matches_reference(schedule):
    """The softmax denominator summed from float32 weights (FA3's convention) instead of the
    rounded ones: within the same tolerance of the reference, on both schedules."""
    check_attend(*mixed_rows(), attend_with(SMALL_SPLIT.replace(schedule=schedule),
                                            sum_rounded_weights=False))


@pytest.mark.parametrize("schedule, pages_per_iter", [("rows", 2), ("rows", 1),
                                                      ("balanced", 2)])
def test_fa3_tile_order_matches_reference(schedule, pages_per_iter):
    """FA3's loop order and rounding (tiles last to first, the max over raw scores, the scale
    in the exponent's multiply-add) with its normalizer: still exact attention, on both
    schedules, one-page and partial tiles included; and on the rows schedule, whose chunks
    hold several tiles, it is another computation: with the same normalizer its outputs round
    differently from the default order's somewhere (the balanced schedule's short segments
    here are about one tile, where the two orders coincide in the interpreter, whose fma is a
    multiply and an add)."""
    inputs = mixed_rows()
    split = SMALL_SPLIT.replace(schedule=schedule)
    default_order = moira.attend(*inputs, config=attend_with(
        split, pages_per_iter=pages_per_iter, sum_rounded_weights=False))
    config = attend_with(split, pages_per_iter=pages_per_iter, sum_rounded_weights=False,
                         fa3_tile_order=True)
    check_attend(*inputs, config)
    if schedule == "rows":
        assert not torch.equal(moira.attend(*inputs, config=config), default_order)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attend_default_config_and_dtypes(dtype):
    num_kv_heads, group, head_dim = 2, 4, 128
    keys, values = make_cache(160, num_kv_heads, head_dim, dtype=dtype)
    table, seq_lens = make_table([64 * 30 + 17, 64 * 50, 33], 160, extra_columns=0)
    query = make_query(3, num_kv_heads * group, head_dim, dtype=dtype)
    # J = max(32, 4096 / 6) = 683 programs per row; rows of 31 and 50 pages split in 2 and 3
    page_lists, page_counts = random_lists(seq_lens.cpu(), num_kv_heads, table.shape[1],
                                           fraction=0.9)
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, MoiraConfig(),
                 scale=0.05)


def test_padded_rows_output_zeros():
    keys, values = make_cache(10, 1, 64)
    table, seq_lens = make_table([0, 64 * 3, 0], 10, extra_columns=0)
    query = make_query(3, 4, 64)
    page_lists = torch.tensor([[[0, 0, 0]], [[2, 0, 1]], [[0, 0, 0]]], dtype=torch.int32,
                              device=DEVICE)
    page_counts = torch.tensor([[0], [3], [0]], dtype=torch.int32, device=DEVICE)
    out = check_attend(query, keys, values, table, seq_lens, page_lists, page_counts,
                       SMALL_SPLIT)
    assert (out[0] == 0).all() and (out[2] == 0).all()


def test_pages_past_seq_len_are_masked():
    # a list may name pages at or past seq_len (e.g. a fixed window): they contribute nothing
    keys, values = make_cache(12, 1, 64)
    table, seq_lens = make_table([64 * 2 + 5], 12, extra_columns=3)
    query = make_query(1, 4, 64)
    page_lists = torch.tensor([[[0, 1, 2, 3, 4]]], dtype=torch.int32, device=DEVICE)
    page_counts = torch.tensor([[5]], dtype=torch.int32, device=DEVICE)
    out = check_attend(query, keys, values, table, seq_lens, page_lists, page_counts,
                       SMALL_SPLIT)
    dense = ref.dense_attention(*(t.cpu() for t in (query, keys, values, table, seq_lens)))
    assert (out.float().cpu() - dense).abs().max() < 2e-2


@pytest.mark.parametrize("pages_per_iter, ahead, implementation", [
    (1, False, "triton"), (2, False, "triton"), (1, True, "triton"), (2, True, "triton"),
    pytest.param(2, False, "cuda", marks=pytest.mark.cuda)])  # attend_cuda.cu
def test_list_entries_outside_the_table_read_nothing(pages_per_iter, ahead, implementation):
    # -1 (the reference's padding) and entries past the table's width, inside the count: they
    # must not read another request's page (row 1's -1 would be row 0's last column)
    config = attend_with(backend=implementation) if implementation == "cuda" else \
        attend_with(pages_per_iter=pages_per_iter, page_ids_ahead=ahead)
    keys, values = make_cache(12, 1, 64)
    table, _ = make_table([64 * 3, 64 * 3], 12, extra_columns=0)
    table = table[:, :2]  # narrower than the rows: seq_len reaches past the table
    seq_lens = torch.tensor([64 * 3, 64 * 3], dtype=torch.int32, device=DEVICE)
    poison_unread_slots(keys, values, table, seq_lens)  # what an entry outside would read
    query = make_query(2, 4, 64)
    page_lists = torch.tensor([[[0, 1, 2, -1]], [[-1, 0, 5, 1]]], dtype=torch.int32,
                              device=DEVICE)
    page_counts = torch.tensor([[4], [4]], dtype=torch.int32, device=DEVICE)
    out = check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config)
    in_table = torch.tensor([[[0, 1]], [[0, 1]]], dtype=torch.int32, device=DEVICE)
    expected = moira.attend(query, keys, values, table, seq_lens, in_table,
                            torch.full((2, 1), 2, dtype=torch.int32, device=DEVICE),
                            config=config)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("even", [True, False])
def test_equal_chunks_and_eq4_chunks(even):
    """Rows whose Eq. (4) chunks are unequal (C = 4, J = 3: 5, 6 and 9 pages are 4 + 1, 4 + 2
    and 4 + 4 + 1, equal 3 + 2, 3 + 3 and 3 + 3 + 3): both rules (``attend.even_chunks``), with
    Merge, against the reference."""
    config = attend_with(MoiraConfig(chunk_pages=4, floor_rows=1, min_chunks_per_row=3,
                                     min_programs=8), even_chunks=even)
    num_kv_heads, group, head_dim = 2, 4, 64
    keys, values = make_cache(40, num_kv_heads, head_dim)
    table, seq_lens = make_table([64 * 4 + 10, 64 * 6, 64 * 8 + 1, 1], 40)
    query = make_query(len(seq_lens), num_kv_heads * group, head_dim)
    page_lists, page_counts = random_lists(seq_lens.cpu(), num_kv_heads, table.shape[1],
                                           fraction=1.0, shuffle=True)
    _, eq4_chunk, _ = ref.work_split(page_counts.cpu(), page_counts.numel(), config,
                                     table.shape[1], even=False)
    _, equal_chunk, _ = ref.work_split(page_counts.cpu(), page_counts.numel(), config,
                                       table.shape[1], even=True)
    assert (equal_chunk < eq4_chunk).any()  # the two rules split some row differently
    workspace = moira.DecodeWorkspace(len(seq_lens), table.shape[1], num_kv_heads * group,
                                      num_kv_heads, head_dim, device=DEVICE, config=config)
    out = poisoned(*query.shape, dtype=query.dtype)
    moira.attend(query, keys, values, table, seq_lens, page_lists, page_counts,
                 workspace=workspace, out=out)
    args = [t.cpu() for t in (query, keys, values, table, seq_lens, page_lists, page_counts)]
    assert_attention_close(out, ref.attend(*args), ref.attend(*args, dtype=query.dtype))


def test_a_page_listed_twice_is_refused():
    """Attend reads every listed entry: a page listed twice would count twice (a silent wrong
    answer), so the public call refuses it; repeats past the count or outside the table read
    nothing and pass."""
    keys, values = make_cache(12, 2, 64)
    table, seq_lens = make_table([64 * 4, 64 * 3], 12, extra_columns=1)
    query = make_query(2, 8, 64)
    counts = torch.tensor([[3, 3], [3, 2]], dtype=torch.int32, device=DEVICE)
    lists = torch.tensor([[[0, 1, 3, 1], [0, 2, 3, 3]], [[0, 1, 2, 0], [0, 2, 2, 2]]],
                         dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"row \(request 1, KV head 1\) lists page 2 more "
                                         r"than once"):
        moira.attend(query, keys, values, table, seq_lens, lists, counts.clone().fill_(3))
    moira.attend(query, keys, values, table, seq_lens, lists, counts)  # repeats past the count
    outside = torch.tensor([[[0, -1, -1, 9], [0, 9, 9, 1]], [[0, 1, 2, 0], [0, 2, 1, 1]]],
                           dtype=torch.int32, device=DEVICE)
    moira.attend(query, keys, values, table, seq_lens, outside, counts.clone().fill_(3))
