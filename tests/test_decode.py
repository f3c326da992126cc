"""The whole step through the public API: sparse_decode against the float32 reference."""

import pytest
import torch
from helpers import (DEVICE, SMALL_SPLIT, assert_attention_close, make_cache, make_query,
                     make_table, poisoned)

import moira
from moira import reference as ref
from moira.synthetic import synthetic_context


def structured_step(batch=3, num_kv_heads=2, group=4, head_dim=64, context=64 * 24 + 9):
    ctx = synthetic_context(context, batch=batch, num_kv_heads=num_kv_heads, group=group,
                            head_dim=head_dim, device=DEVICE, seed=int(torch.randint(1000, ())))
    summaries = moira.summarize(ctx.key_cache, ctx.block_table, ctx.seq_lens,
                                torch.zeros(ctx.key_cache.shape[0], num_kv_heads, 2, head_dim,
                                            device=DEVICE))
    return ctx, summaries


def cpu(*tensors):
    return [t.cpu() for t in tensors]


PDL = dict(programmatic_launch=True)


@pytest.mark.parametrize("group, head_dim, options",
                         [(group, head_dim, {}) for group in (1, 4, 7, 8)
                          for head_dim in (64, 128)]
                         # on a GPU, one eager step with griddepcontrol between the kernels
                         # (the interpreter launches plainly; the race test is in
                         # test_cuda_graph.py)
                         + [pytest.param(4, 128, PDL, marks=pytest.mark.cuda)])
def test_sparse_decode_matches_reference(group, head_dim, options):
    ctx, summaries = structured_step(group=group, head_dim=head_dim)
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    out = poisoned(*ctx.query.shape)
    out, page_lists, page_counts = moira.sparse_decode(
        *inputs, gamma=0.9, config=SMALL_SPLIT.replace(**options), return_pages=True, out=out)

    expected_lists, expected_counts = ref.select(
        ref.estimate(*cpu(ctx.query, ctx.key_cache, summaries, ctx.block_table, ctx.seq_lens)),
        ctx.seq_lens.cpu(), gamma=0.9)
    # the lists may differ only by pages within 1e-6 of the threshold; on these inputs, never
    assert torch.equal(page_counts.cpu(), expected_counts)
    for b in range(ctx.query.shape[0]):
        for h in range(page_counts.shape[1]):
            n = int(page_counts[b, h])
            assert torch.equal(page_lists[b, h, :n].cpu(), expected_lists[b, h, :n])
    assert (page_counts.cpu() < ref.num_pages(ctx.seq_lens[0], 1 << 20)).any()  # it is sparse

    lists_and_counts = cpu(page_lists, page_counts)
    base = cpu(ctx.query, ctx.key_cache, ctx.value_cache, ctx.block_table, ctx.seq_lens)
    assert_attention_close(out, ref.attend(*base, *lists_and_counts),
                           ref.attend(*base, *lists_and_counts, dtype=torch.bfloat16))


EDGE_LENGTHS = [1, 64, 65, 128, 64 * 9, 64 * 9 + 1, 0]  # one token, full current pages, padding


@pytest.mark.parametrize("group", [1, 7])
@pytest.mark.parametrize("mode", ["gamma", "top_k", "keep_fractions"])
def test_edge_rows_match_reference_in_every_mode(group, mode):
    """The whole step on rows of one token, one and two full pages (the step summarizes the
    page its token filled), a partial last page and a padded row, in each selection mode:
    lists, counts and output against the reference."""
    num_kv_heads, head_dim = 2, 64
    keys, values = make_cache(90, num_kv_heads, head_dim)
    table, seq_lens = make_table(EDGE_LENGTHS, 90)
    query = make_query(len(EDGE_LENGTHS), num_kv_heads * group, head_dim)
    summaries = moira.summarize(keys, table, seq_lens,
                                poisoned(90, num_kv_heads, 2, head_dim, dtype=torch.float32))
    fractions = torch.tensor([0.5, 0.3], device=DEVICE)
    selection = {"gamma": dict(gamma=0.9), "top_k": dict(top_k=3),
                 "keep_fractions": dict(keep_fractions=fractions)}[mode]
    out, page_lists, page_counts = moira.sparse_decode(
        query, keys, values, summaries, table, seq_lens, config=SMALL_SPLIT, return_pages=True,
        out=poisoned(*query.shape), **selection)

    reference_selection = dict(selection, keep_fractions=fractions.cpu()) \
        if mode == "keep_fractions" else selection
    expected_lists, expected_counts = ref.select(
        ref.estimate(*cpu(query, keys, summaries, table, seq_lens)), seq_lens.cpu(),
        **reference_selection)
    assert torch.equal(page_counts.cpu(), expected_counts)
    for b in range(len(EDGE_LENGTHS)):
        for h in range(num_kv_heads):
            n = int(page_counts[b, h])
            assert torch.equal(page_lists[b, h, :n].cpu(), expected_lists[b, h, :n])
    base = cpu(query, keys, values, table, seq_lens)
    lists_and_counts = cpu(page_lists, page_counts)
    assert_attention_close(out, ref.attend(*base, *lists_and_counts),
                           ref.attend(*base, *lists_and_counts, dtype=torch.bfloat16))
    assert (out[-1] == 0).all()  # the padded row, written (the output was poisoned)


@pytest.mark.parametrize("layout", ["packed", "hnd", "packed_hnd"])
def test_gamma_one_is_dense(layout):
    num_kv_heads, group, head_dim = 2, 4, 128
    keys, values = make_cache(80, num_kv_heads, head_dim, layout=layout)
    table, seq_lens = make_table([1, 64, 65, 64 * 11 + 40, 0], 80)
    query = make_query(5, num_kv_heads * group, head_dim)
    summaries = moira.summarize(keys, table, seq_lens)
    out, _, page_counts = moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                              gamma=1.0, config=SMALL_SPLIT, return_pages=True,
                                              out=poisoned(*query.shape))
    assert page_counts.tolist() == [[1, 1], [1, 1], [2, 2], [12, 12], [0, 0]]
    base = cpu(query, keys, values, table, seq_lens)
    assert_attention_close(out, ref.dense_attention(*base),
                           ref.dense_attention(*base, dtype=torch.bfloat16))
    assert (out[4] == 0).all()  # the padded row


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_step_summarizes_the_page_its_token_filled(head_dim):
    """A decode step writes the summary of each row's current page once it is full (the
    plugin runs no summarize launch in decode steps), also for rows read in full; partial pages
    and every other page stay as they were."""
    num_kv_heads, group = 2, 4
    keys, values = make_cache(40, num_kv_heads, head_dim)
    lengths = [64 * 5, 64 * 5 + 3, 64 * 3, 0]
    table, seq_lens = make_table(lengths, 40)
    query = make_query(4, num_kv_heads * group, head_dim)
    expected = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu())
    summaries = moira.summarize(keys, table, seq_lens, expected.clone().to(DEVICE))
    filled = [int(table[0, 4]), int(table[2, 2])]  # the current pages this step filled
    partial = int(table[1, 5])
    summaries[filled] = float("nan")
    summaries[partial] = float("nan")
    before = summaries.clone()
    out = moira.sparse_decode(query, keys, values, summaries, table, seq_lens, gamma=0.9,
                              dense_below_pages=3, config=SMALL_SPLIT)
    torch.testing.assert_close(summaries[filled].cpu(), expected[filled])
    assert torch.isnan(summaries[partial]).all()
    others = torch.ones(summaries.shape[0], dtype=torch.bool)
    others[filled] = False
    torch.testing.assert_close(summaries[others], before[others], equal_nan=True)
    assert not torch.isnan(out[:3].float()).any()  # the poisoned pages were never read


@pytest.mark.parametrize("group, head_dim, layout", [(1, 64, "contiguous"), (4, 128, "packed"),
                                                     (7, 128, "hnd"), (8, 64, "contiguous"),
                                                     (4, 64, "packed_hnd")])
def test_the_step_writes_its_new_tokens_first(group, head_dim, layout):
    """With new_keys / new_values / slot_mapping, Estimate's launch writes the tokens before
    any kernel reads them: caches, summaries, lists and outputs equal, bit for bit, those of
    the step run on caches the spec wrote beforehand. Rows: a token that fills its page (the
    step summarizes it, new key included), a token alone on its page, a first page, one
    partial page in a longer row, and a padded row (slot -1, length 0)."""
    num_kv_heads = 2
    lengths = [64 * 5, 64 * 3 + 1, 40, 64 * 4 + 17, 0]
    keys, values = make_cache(40, num_kv_heads, head_dim, layout=layout)
    table, seq_lens = make_table(lengths, 40)
    batch = len(lengths)
    query = make_query(batch, num_kv_heads * group, head_dim)
    new_keys, new_values = (torch.randn(batch, num_kv_heads, head_dim, device=DEVICE)
                            .to(keys.dtype) for _ in range(2))
    slots = torch.tensor([int(table[b, (n - 1) // 64]) * 64 + (n - 1) % 64 if n else -1
                          for b, n in enumerate(lengths)], dtype=torch.int64, device=DEVICE)
    # the pages full before this step's tokens
    summaries = moira.summarize(keys, table, (seq_lens - 1).clamp(min=0),
                                torch.zeros(40, num_kv_heads, 2, head_dim, device=DEVICE))
    runs = {}
    for fused in (True, False):
        k, v, s = keys.clone(), values.clone(), summaries.clone()
        new_kv = dict(new_keys=new_keys, new_values=new_values, slot_mapping=slots)
        if not fused:
            ref.write_tokens(k, v, new_keys, new_values, slots)
            new_kv = {}
        out, lists, counts = moira.sparse_decode(
            query, k, v, s, table, seq_lens, gamma=0.9, config=SMALL_SPLIT, return_pages=True,
            out=poisoned(*query.shape), **new_kv)
        runs[fused] = (k, v, s, out, lists.clone(), counts.clone())
    (k, v, s, out, lists, counts), (k0, v0, s0, out0, lists0, counts0) = runs[True], runs[False]
    assert torch.equal(k, k0) and torch.equal(v, v0)  # the kernel's write is the spec's
    assert not torch.equal(k, keys)  # and it wrote
    assert torch.equal(s, s0)  # the filled page summarized with its new key
    assert not torch.equal(s[int(table[0, 4])], summaries[int(table[0, 4])])
    assert torch.equal(counts, counts0)
    for b in range(batch):
        for h in range(num_kv_heads):
            n = int(counts[b, h])
            assert torch.equal(lists[b, h, :n], lists0[b, h, :n])
    assert torch.equal(out, out0) and not torch.isnan(out.float()).any()
    assert (out[4] == 0).all()  # the padded row


def test_new_tokens_need_all_three_tensors_of_the_right_shape():
    step = good_step()
    keys = torch.zeros(1, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="go together; got only new_keys, slot_mapping"):
        call(step, new_keys=keys, slot_mapping=slots)
    with pytest.raises(ValueError, match=r"new_values must be torch.bfloat16 \[batch, "):
        call(step, new_keys=keys, new_values=keys[:, :1], slot_mapping=slots)
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D int32/int64"):
        call(step, new_keys=keys, new_values=keys, slot_mapping=slots.float())


def test_page_stats_count_pages_read_and_pages_present():
    ctx, summaries = structured_step()
    stats = torch.tensor([5, 7], dtype=torch.int64, device=DEVICE)  # accumulates onto these
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    _, _, page_counts = moira.sparse_decode(*inputs, gamma=0.9, config=SMALL_SPLIT,
                                            return_pages=True, page_stats=stats)
    pages_present = sum(-(-int(n) // 64) for n in ctx.seq_lens) * page_counts.shape[1]
    assert stats.tolist() == [5 + int(page_counts.sum()), 7 + pages_present]
    assert int(page_counts.sum()) < pages_present
    with pytest.raises(ValueError, match="page_stats must be an int64"):
        moira.sparse_decode(*inputs, page_stats=stats.int())


def test_build_only_launches_nothing():
    """Inside ``launch.build_only()`` (the vLLM plugin's warm-up of the kernels only mixed
    steps launch) the step and the slot summaries write nothing; outside they do."""
    from moira.kernels import launch

    ctx, summaries = structured_step()
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    out, stats, before = poisoned(*ctx.query.shape), torch.zeros(2, dtype=torch.int64,
                                                                 device=DEVICE), summaries.clone()
    page = int(ctx.block_table[0, 0])
    slots = torch.tensor([page * 64 + 63], dtype=torch.int64, device=DEVICE)  # a filled page
    summaries[page] = 0
    zeroed = summaries.clone()
    with launch.build_only():
        moira.sparse_decode(*inputs, gamma=0.9, config=SMALL_SPLIT, out=out, page_stats=stats)
        moira.update_summaries(ctx.key_cache, slots, summaries)
    assert torch.isnan(out.float()).all() and not stats.any()
    assert torch.equal(summaries, zeroed)
    with pytest.raises(RuntimeError):  # the previous mode comes back after an error
        with launch.build_only():
            raise RuntimeError
    moira.sparse_decode(*inputs, gamma=0.9, config=SMALL_SPLIT, out=out, page_stats=stats)
    moira.update_summaries(ctx.key_cache, slots, summaries)
    assert not torch.isnan(out.float()).any() and stats.all()
    assert torch.equal(summaries[page], before[page])


@pytest.mark.cuda
def test_build_only_builds_what_the_launch_then_uses():
    """On a GPU, Estimate and the slot summaries built inside ``build_only()`` are what later
    launches use: nothing compiles at the launch, whatever the step's ``dense_below_pages``
    (the plugin builds once, in the warm-up of the largest graph's batch, and a mixed step
    plans for its own batch: 320 pages at batch 1, 40 at 8, 1 at 256)."""
    import triton

    from moira.kernels import launch

    ctx, summaries = structured_step(num_kv_heads=3, group=3, head_dim=64)  # a rare geometry
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    slots = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    compiled = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        with launch.build_only():
            moira.sparse_decode(*inputs, gamma=0.9, dense_below_pages=320)
            for start in (0, 1):
                moira.update_summaries(ctx.key_cache, slots[start:], summaries)
        built = len(compiled)
        for pages in (320, 40, 1):
            moira.sparse_decode(*inputs, gamma=0.9, dense_below_pages=pages)
        for start in (0, 1):
            moira.update_summaries(ctx.key_cache, slots[start:], summaries)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook
    # (Select builds per class of its own dense_below_pages: in vLLM, graph capture runs
    # every planned batch's decode step, so its builds are done before serving)
    late = [name for name in compiled[built:]
            if name in ("_estimate_kernel", "_summarize_filled_slots_kernel")]
    assert not late, f"compiled at launch after the build: {late}"


def test_fraction_mode_through_the_step():
    ctx, summaries = structured_step()
    fractions = torch.tensor([0.25, 0.5], device=DEVICE)
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    out, page_lists, page_counts = moira.sparse_decode(*inputs, keep_fractions=fractions,
                                                       config=SMALL_SPLIT, return_pages=True)
    pages = [-(-int(n) // 64) for n in ctx.seq_lens]  # e.g. 25: 6.25 -> 6, 12.5 -> 13 pages
    assert page_counts.cpu().tolist() == [[int(0.25 * n + 0.5), int(0.5 * n + 0.5)]
                                          for n in pages]
    expected_lists, expected_counts = ref.select(
        ref.estimate(*cpu(ctx.query, ctx.key_cache, summaries, ctx.block_table, ctx.seq_lens)),
        ctx.seq_lens.cpu(), keep_fractions=fractions.cpu())
    assert torch.equal(page_counts.cpu(), expected_counts)
    base = cpu(ctx.query, ctx.key_cache, ctx.value_cache, ctx.block_table, ctx.seq_lens)
    lists_and_counts = cpu(page_lists, page_counts)
    assert_attention_close(out, ref.attend(*base, *lists_and_counts),
                           ref.attend(*base, *lists_and_counts, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="either top_k or keep_fractions"):
        moira.sparse_decode(*inputs, keep_fractions=fractions, top_k=4)
    with pytest.raises(ValueError, match="keep_fractions must be a float32"):
        moira.sparse_decode(*inputs, keep_fractions=fractions.double())


def test_coverage_targets_per_kv_head():
    ctx, summaries = structured_step()
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    targets = torch.tensor([0.5, 1.0], device=DEVICE)
    _, _, counts = moira.sparse_decode(*inputs, gamma=targets, config=SMALL_SPLIT,
                                       return_pages=True)
    counts = counts.cpu()
    for head, gamma in enumerate(targets.tolist()):  # each head as with that scalar target
        _, _, alone = moira.sparse_decode(*inputs, gamma=gamma, config=SMALL_SPLIT,
                                          return_pages=True)
        assert torch.equal(counts[:, head], alone.cpu()[:, head])
    assert counts[:, 1].tolist() == [-(-int(n) // 64) for n in ctx.seq_lens]  # 1.0: all
    assert (counts[:, 0] < counts[:, 1]).all()
    with pytest.raises(ValueError, match="gamma must be a float32"):
        moira.sparse_decode(*inputs, gamma=targets[:1])
    with pytest.raises(ValueError, match="apply to the coverage rule"):
        moira.sparse_decode(*inputs, gamma=targets, top_k=4)
    with pytest.raises(ValueError, match="apply to the coverage rule"):
        moira.sparse_decode(*inputs, gamma=targets, config=SMALL_SPLIT.replace(top_k=4))


def test_gamma_with_top_k_is_refused():
    """top_k fixes the page count, so a gamma beside it (as an argument or from the config)
    would be ignored: a ValueError naming both."""
    ctx, summaries = structured_step(batch=1)
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    with pytest.raises(ValueError, match=r"either gamma \(0.9\) or top_k \(4\)"):
        moira.sparse_decode(*inputs, gamma=0.9, top_k=4)
    with pytest.raises(ValueError, match=r"gamma=0.9 applies to the coverage rule.*top_k=4"):
        moira.sparse_decode(*inputs, gamma=0.9, config=SMALL_SPLIT.replace(top_k=4))
    moira.sparse_decode(*inputs, top_k=4, config=SMALL_SPLIT)  # alone, each is fine
    moira.sparse_decode(*inputs, gamma=0.9, config=SMALL_SPLIT)


@pytest.mark.parametrize("name", ["gamma", "keep_fractions"])
@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan")])
def test_per_row_values_in_host_memory_are_checked(name, bad):
    """Per-row targets and fractions outside (0, 1] are refused where reading them costs no
    sync (tensors in host memory); on a GPU the kernels saturate them instead (next test)."""
    ctx, summaries = structured_step(batch=2)
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    values = torch.tensor([0.5, bad], device=DEVICE)
    if values.device.type != "cpu":
        pytest.skip("checked on the host only for tensors in host memory")
    with pytest.raises(ValueError, match=rf"{name} must lie in \(0, 1\].*1 of 2 outside"):
        moira.sparse_decode(*inputs, **{name: values}, config=SMALL_SPLIT)


@pytest.mark.parametrize("name, values, clamped", [
    ("gamma", [1.5, -0.5], [1.0, 1e-9]),
    ("keep_fractions", [2.0, -1.0], [1.0, 1e-9]),
])
def test_kernels_saturate_per_row_values_as_the_spec_does(monkeypatch, name, values, clamped):
    """Values outside (0, 1] that reach the kernels (GPU tensors are not read on the host):
    a target or fraction of 1 or more keeps every page, one at or below 0 keeps the sink and
    the current page only; the float32 spec does the same, so it is the spec of both."""
    host_check = moira.checks.row_values
    monkeypatch.setattr(moira.checks, "row_values",  # as for a GPU tensor: no value check
                        lambda n, v, *args: host_check(n, v.clamp(1e-9, 1), *args))
    ctx, summaries = structured_step(batch=2)
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    workspace = moira.DecodeWorkspace.for_step(ctx.query, ctx.key_cache, ctx.block_table,
                                               config=SMALL_SPLIT)
    _, _, counts = moira.sparse_decode(*inputs, **{name: torch.tensor(values, device=DEVICE)},
                                       workspace=workspace, return_pages=True)
    log_masses = workspace.selection_buffers(2, ctx.block_table.shape[1])[0].cpu()
    log_masses = log_masses.view(2, 2, -1, log_masses.shape[-1])
    pages = [-(-int(n) // 64) for n in ctx.seq_lens]
    assert counts.cpu().tolist() == [[n, 2] for n in pages]
    for given in (values, clamped):
        _, expected = ref.select(log_masses, ctx.seq_lens.cpu(), **{name: torch.tensor(given)})
        assert torch.equal(counts.cpu(), expected)


def test_negative_lengths_are_padded_rows():
    """0 and negative lengths both mark a padded row: no pages, output zeros, in the kernels
    and in the spec."""
    keys, values = make_cache(40, 2, 64)
    table, seq_lens = make_table([64 * 5 + 3, 0, 64 * 3], 40)
    seq_lens[1], seq_lens[2] = -100, -1
    query = make_query(3, 8, 64)
    summaries = moira.summarize(keys, table, seq_lens.clamp(min=0))
    out, page_lists, page_counts = moira.sparse_decode(
        query, keys, values, summaries, table, seq_lens, config=SMALL_SPLIT,
        return_pages=True, out=poisoned(*query.shape))
    assert page_counts[0].min() >= 2
    assert page_counts[1:].cpu().tolist() == [[0, 0], [0, 0]]
    assert (out[1:] == 0).all()
    base = cpu(query, keys, values, table, seq_lens)
    expected_lists, expected_counts = ref.select(ref.estimate(*cpu(query, keys, summaries, table,
                                                                   seq_lens)), seq_lens.cpu())
    assert expected_counts[1:].tolist() == [[0, 0], [0, 0]]
    assert torch.equal(page_counts.cpu(), expected_counts)
    dense = ref.dense_attention(*base)
    assert (dense[1:] == 0).all()
    assert_attention_close(out, ref.attend(*base, *cpu(page_lists, page_counts)),
                           ref.attend(*base, *cpu(page_lists, page_counts),
                                      dtype=torch.bfloat16))


@pytest.mark.parametrize("how", ["config", "argument"])
def test_short_rows_read_every_page(how):
    ctx, summaries = structured_step()
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table,
              ctx.seq_lens)
    pages = [-(-int(n) // 64) for n in ctx.seq_lens]
    threshold = sorted(pages)[len(pages) // 2]  # about half the rows are short
    if how == "config":
        options = dict(config=SMALL_SPLIT.replace(dense_below_pages=threshold))
    else:  # the per-step override the vLLM plugin passes (the workspace's config says 0)
        options = dict(workspace=moira.DecodeWorkspace.for_step(
            ctx.query, ctx.key_cache, ctx.block_table, config=SMALL_SPLIT),
            dense_below_pages=threshold)
    out, _, counts = moira.sparse_decode(*inputs, gamma=0.5, return_pages=True, **options)
    _, _, sparse = moira.sparse_decode(*inputs, gamma=0.5, config=SMALL_SPLIT,
                                       return_pages=True)
    for row, n in enumerate(pages):
        if n <= threshold:
            assert counts[row].tolist() == [n] * counts.shape[1]
        else:  # long rows: selected exactly as without the threshold
            assert torch.equal(counts[row].cpu(), sparse[row].cpu())
    assert any(n > threshold for n in pages) and any(n <= threshold for n in pages)
    with pytest.raises(ValueError, match="dense_below_pages must be an int >= 0"):
        moira.MoiraConfig(dense_below_pages=-1)


def test_planned_batch_splits_rows_as_the_padded_batch_does(monkeypatch):
    """A CUDA graph captured for a padded batch replays that batch's split; an eager step of
    the real requests planned for the same padded size splits every row alike and gives
    bit-identical outputs (vLLM's FULL graphs against graph mode NONE)."""
    import moira.decode
    splits = []
    merge = moira.decode.triton_merge.merge  # Merge plans the split Attend ran, on any backend
    monkeypatch.setattr(moira.decode.triton_merge, "merge", lambda *args, **kwargs: (
        splits.append((kwargs["chunk_floor"], kwargs["chunks_per_row"], kwargs["step_rows"])),
        merge(*args, **kwargs))[1])
    ctx, summaries = structured_step(batch=3)
    # the split depends on the row count here: 6 rows C = 3, J = 8; 8 rows C = 4, J = 6
    config = moira.MoiraConfig(chunk_pages=8, floor_rows=16, min_chunks_per_row=2,
                               min_programs=48)

    def padded(t):  # one more request of length 0: how vLLM pads a batch to its graph size
        return torch.cat([t, torch.zeros_like(t[:1])])

    caches = (ctx.key_cache, ctx.value_cache, summaries)
    replay = moira.sparse_decode(padded(ctx.query), *caches, padded(ctx.block_table),
                                 padded(ctx.seq_lens), config=config,
                                 out=poisoned(4, *ctx.query.shape[1:]))
    eager = moira.sparse_decode(ctx.query, *caches, ctx.block_table, ctx.seq_lens,
                                config=config, planned_batch=4, out=poisoned(*ctx.query.shape))
    unplanned = moira.sparse_decode(ctx.query, *caches, ctx.block_table, ctx.seq_lens,
                                    config=config)
    assert splits[0] == splits[1] != splits[2]
    assert splits[1][2] == 8 and splits[2][2] == 6  # the short-row floor's rows: the planned
    assert torch.equal(eager, replay[:3])
    assert not replay[3].any()  # the padded row's output is zeros
    # another split rounds differently, nothing more
    torch.testing.assert_close(unplanned.float(), eager.float(), atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="planned_batch must be an int >= the batch"):
        moira.sparse_decode(ctx.query, *caches, ctx.block_table, ctx.seq_lens, planned_batch=2)


def test_fixed_count_mode():
    ctx, summaries = structured_step()
    out, page_lists, page_counts = moira.sparse_decode(
        ctx.query, ctx.key_cache, ctx.value_cache, summaries, ctx.block_table, ctx.seq_lens,
        top_k=5, config=SMALL_SPLIT, return_pages=True)
    assert (page_counts == 5).all()


def test_workspace_is_reused_across_batches_and_widths():
    ctx, summaries = structured_step(batch=3)
    workspace = moira.DecodeWorkspace(4, 40, 8, 2, 64, device=DEVICE, config=SMALL_SPLIT)
    inputs = (ctx.query, ctx.key_cache, ctx.value_cache, summaries)
    first = moira.sparse_decode(*inputs, ctx.block_table, ctx.seq_lens, workspace=workspace)
    fresh = moira.sparse_decode(*inputs, ctx.block_table, ctx.seq_lens, config=SMALL_SPLIT)
    assert torch.equal(first, fresh)
    sub = moira.sparse_decode(ctx.query[:2], *inputs[1:], ctx.block_table[:2, :30],
                              ctx.seq_lens[:2], workspace=workspace)
    assert torch.equal(sub, first[:2])
    with pytest.raises(ValueError, match="max_batch"):
        moira.sparse_decode(torch.cat([ctx.query] * 2), *inputs[1:],
                            torch.cat([ctx.block_table] * 2), torch.cat([ctx.seq_lens] * 2),
                            workspace=workspace)


# --------------------------------------------------------------------------------------------
# Bad arguments: a ValueError that names the argument
# --------------------------------------------------------------------------------------------


def good_step():
    keys, values = make_cache(8, 2, 64)
    table, seq_lens = make_table([100], 8)
    query = make_query(1, 8, 64)
    summaries = moira.summarize(keys, table, seq_lens)
    return dict(query=query, key_cache=keys, value_cache=values, summaries=summaries,
                block_table=table, seq_lens=seq_lens)


def call(step, **kwargs):
    return moira.sparse_decode(step["query"], step["key_cache"], step["value_cache"],
                               step["summaries"], step["block_table"], step["seq_lens"],
                               **kwargs)


@pytest.mark.parametrize("name, change, match", [
    ("query", lambda t: t.float(), "query dtype"),
    ("query", lambda t: t[0], "query must be"),
    ("query", lambda t: t[:, :7], "multiple"),
    ("key_cache", lambda t: t.float(), "key_cache has dtype"),
    ("key_cache", lambda t: t.to(torch.float8_e4m3fn), "FP8"),
    ("key_cache", lambda t: t[:, :16], "64-token pages"),
    ("key_cache", lambda t: torch.cat([t, t[..., :32]], -1), "head_dim 96"),
    ("value_cache", lambda t: t[:4], "value_cache shape"),
    ("value_cache", lambda t: t.half(), "value_cache dtype"),
    ("summaries", lambda t: t[..., :1, :], "summaries for estimator=.mvar. must have shape"),
    ("summaries", lambda t: t.double(), "summaries dtype"),
    ("block_table", lambda t: t.long(), "block_table"),
    ("block_table", lambda t: torch.cat([t, t]), "seq_lens has 1 rows but block_table has 2"),
    ("seq_lens", lambda t: t.long(), "seq_lens"),
    # the kernels step through these one element at a time: a strided view would be misread
    ("block_table", lambda t: torch.stack([t, t], -1)[..., 0], "block_table must be contiguous"),
    ("value_cache", lambda t: None, "value_cache must be a torch.Tensor"),
    ("key_cache", lambda t: t[:, :, :0], "no KV heads"),
    ("query", lambda t: t[:0], "batch 0"),
])
def test_bad_inputs_raise_value_error(name, change, match):
    step = good_step()
    step[name] = change(step[name])
    with pytest.raises(ValueError, match=match):
        call(step)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma=0.0), "gamma"), (dict(gamma=1.5), "gamma"), (dict(top_k=1), "top_k"),
    (dict(scale=-1.0), "scale"), (dict(scale=True), "scale"),
    (dict(out=torch.empty(2, 3)), "out must match"),
    (dict(page_stats=torch.zeros(4, dtype=torch.int64, device=DEVICE)[::2]),
     "page_stats must be contiguous"),
    (dict(config=moira.MoiraConfig(gamma=0.5),
          workspace=moira.DecodeWorkspace(1, 8, 8, 2, 64, device=DEVICE)),
     "differs from the workspace's"),
    (dict(config=moira.MoiraConfig(top_k=4),
          keep_fractions=torch.full((2,), 0.5, device=DEVICE)), "keep_fractions and the config"),
    (dict(config="balanced"), "config must be a MoiraConfig"),
    (dict(workspace=True), "workspace must be a DecodeWorkspace"),
    (dict(summaries=None), "summaries must be a torch.Tensor"),
    (dict(block_table=torch.zeros(1, 0, dtype=torch.int32, device=DEVICE)), "no columns"),
])
def test_bad_options_raise_value_error(kwargs, match):
    step = good_step()
    for name in ("summaries", "block_table"):  # tensors of the step given as options
        if name in kwargs:
            step[name] = kwargs.pop(name)
    with pytest.raises(ValueError, match=match):
        call(step, **kwargs)


@pytest.mark.parametrize("changes, match", [
    (dict(num_kv_heads=0), "num_kv_heads must be a positive int"),
    (dict(num_heads=8.0), "num_heads must be a positive int"),
    (dict(max_batch=True), "max_batch must be a positive int"),
    (dict(config={"gamma": 0.9}), "config must be a MoiraConfig"),
])
def test_bad_workspace_arguments_raise_value_error(changes, match):
    arguments = dict(max_batch=1, max_pages_per_seq=8, num_heads=8, num_kv_heads=2, head_dim=64,
                     device=DEVICE) | changes
    with pytest.raises(ValueError, match=match):
        moira.DecodeWorkspace(**arguments)


def test_non_cuda_device_raises(monkeypatch):
    import moira.checks

    step = good_step()
    monkeypatch.setattr(moira.checks, "interpreting", lambda: False)
    if DEVICE == "cuda":
        step = {name: t.cpu() for name, t in step.items()}
    with pytest.raises(ValueError, match="CUDA device"):
        call(step)


def test_attend_checks_page_lists():
    step = good_step()
    lists = torch.zeros(1, 2, 2, dtype=torch.int64, device=DEVICE)
    counts = torch.ones(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="page_lists"):
        moira.attend(step["query"], step["key_cache"], step["value_cache"],
                     step["block_table"], step["seq_lens"], lists, counts)
    with pytest.raises(ValueError, match="page_counts"):
        moira.attend(step["query"], step["key_cache"], step["value_cache"],
                     step["block_table"], step["seq_lens"], lists.int(), counts[:, :1])
    strided = torch.zeros(1, 2, 4, dtype=torch.int32, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="page_lists must be contiguous"):
        moira.attend(step["query"], step["key_cache"], step["value_cache"],
                     step["block_table"], step["seq_lens"], strided, counts)


def test_tables_wider_than_select_holds_are_refused_by_both_entry_points():
    step = good_step()
    wide = torch.zeros(1, moira.config.MAX_PAGES_PER_SEQ + 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_table has 32769 pages per request"):
        call(dict(step, block_table=wide))
    lists = torch.zeros(1, 2, 1, dtype=torch.int32, device=DEVICE)
    counts = torch.ones(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_table has 32769 pages per request"):
        moira.attend(step["query"], step["key_cache"], step["value_cache"], wide,
                     step["seq_lens"], lists, counts)


def test_update_summaries_checks_slot_mapping():
    step = good_step()
    slots = torch.arange(128, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        moira.update_summaries(step["key_cache"], slots[::2], step["summaries"])


def test_programmatic_launch_before_hopper_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="programmatic_launch needs a Hopper.*sm_80"):
        moira.DecodeWorkspace(1, 4, 8, 2, 64, device="cuda",
                              config=moira.MoiraConfig(programmatic_launch=True))


@pytest.mark.parametrize("estimator", ["mvar", "int2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_summary_never_drops_its_page(estimator, bad):
    """One page's summary poisoned (a NaN or infinite key summarized, or memory never
    written): gamma = 1 still reads every page (output as dense), and under the coverage
    rule that page is kept rather than dropped unseen."""
    keys, values = make_cache(24, 2, 64)
    table, seq_lens = make_table([64 * 9 + 5, 64 * 6], 24)
    query = make_query(2, 8, 64)
    config = moira.MoiraConfig(estimator=estimator)
    summaries = moira.summarize(keys, table, seq_lens, estimator=estimator)
    poisoned_page = int(table[0, 4])
    summaries[poisoned_page, :, :2] = bad
    dense = ref.dense_attention(query.cpu(), keys.cpu(), values.cpu(), table.cpu(),
                                seq_lens.cpu())
    out, lists, counts = moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                             gamma=1.0, config=config, return_pages=True)
    assert counts.tolist() == [[10, 10], [6, 6]]
    torch.testing.assert_close(out.float().cpu(), dense, rtol=2e-2, atol=2e-2)
    _, lists, counts = moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                           gamma=0.5, config=config, return_pages=True)
    for h in range(2):
        assert 4 in lists[0, h, : counts[0, h]].tolist()
