"""Estimate in CUDA C++ (``KernelOptions(estimate="cuda")``, moira/kernels/cuda/estimate.cu)
against the reference: GPU only, except the struct mirror (it needs libnvrtc), the grid's
shape, the refusals and the choice by table width."""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import (DEVICE, check_struct_mirror, make_cache, make_query, make_table,
                     needs_nvrtc, poisoned)
from test_estimate import SEQ_LENS

import moira
from moira import KernelOptions, MoiraConfig
from moira import reference as ref
from moira.kernels import backends
from moira.kernels.cuda import build as cuda_build
from moira.kernels.cuda import estimate as estimate_cuda

cuda = pytest.mark.cuda
ON_GPU = DEVICE == "cuda" and cuda_build.nvrtc_library() is not None


def estimate_inputs(lengths, group, head_dim, num_kv_heads=2, num_pages=300,
                    layout="packed", extra_columns=1):
    """``(query, keys, values, summaries, table, seq_lens)``: bf16 summaries of the full pages,
    their variances scaled up so mvar's second term matters."""
    keys, values = make_cache(num_pages, num_kv_heads, head_dim, layout=layout)
    table, seq_lens = make_table(lengths, num_pages, extra_columns=extra_columns)
    query = make_query(len(lengths), num_kv_heads * group, head_dim)
    summaries = ref.summarize(keys.cpu(), table.cpu(), seq_lens.cpu())
    summaries = (summaries * (1 + torch.rand_like(summaries))).to(torch.bfloat16).to(DEVICE)
    return query, keys, values, summaries, table, seq_lens


def workspace_for(query, keys, table, **options):
    """A workspace for this step's shapes whose kernels are ``KernelOptions(**options)``."""
    config = MoiraConfig(kernels=KernelOptions(**options))
    return moira.DecodeWorkspace.for_step(query, keys, table, config)


def estimate(query, keys, summaries, table, seq_lens, scale, log_masses, *, tuning=None,
             dense_below_pages=0, new_kv=None, parts="all"):
    """Estimate under ``KernelOptions(estimate="cuda", tuning=tuning)`` as a step runs it: the
    workspace resolves the stage (a ValueError where the CUDA kernel cannot run), the call's
    inputs are checked (the kernel's ValueError), then the CUDA launcher."""
    workspace = workspace_for(query, keys, table, estimate="cuda", tuning=tuning or {})
    assert backends.estimate(workspace, query, keys, summaries, table, seq_lens, new_kv,
                             log_masses) == "cuda"
    return estimate_cuda.estimate(query, keys, summaries, table, seq_lens, scale, log_masses,
                                  options=workspace.config.kernels,
                                  dense_below_pages=dense_below_pages, new_kv=new_kv,
                                  parts=parts)


def check_log_masses(log_masses, query, keys, summaries, table, seq_lens, scale,
                     dense_below_pages=0):
    """Each row's pages as the reference estimates them (float32 from the same bf16 inputs),
    nothing written past a row or in rows of at most ``dense_below_pages`` pages."""
    expected = ref.estimate(query.cpu(), keys.cpu(), summaries.cpu(), table.cpu(),
                            seq_lens.cpu(), scale)
    got = log_masses.cpu().view_as(expected)
    for b, length in enumerate(seq_lens.tolist()):
        pages = ref.num_pages(length, table.shape[1])
        if pages <= dense_below_pages:
            assert torch.isnan(got[b]).all()
            continue
        torch.testing.assert_close(got[b, :, :, :pages], expected[b, :, :, :pages],
                                   rtol=1e-5, atol=1e-4)
        assert torch.isnan(got[b, :, :, pages:]).all()


@needs_nvrtc
def test_params_mirror_the_kernels_struct():
    """``estimate.Params`` (ctypes) mirrors the kernel's ``Params`` field by field."""
    check_struct_mirror(
        estimate_cuda.SOURCE, estimate_cuda.Params,
        retyped=(b"int num_kv_heads, max_pages, group, dense_below_pages",
                 b"int num_kv_heads, max_pages; float group; int dense_below_pages", "group"),
        swapped=(b"const bf16* new_keys;\n  const bf16* new_values;",
                 b"const bf16* new_values;\n  const bf16* new_keys;"))


def test_mvar_tile_is_the_kernels():
    """Pages per mvar pass (the grid's J follows it): 4 warps x loads x pages per load."""
    assert estimate_cuda.tile_pages(128, 4) == 32 and estimate_cuda.tile_pages(128, 7) == 16
    assert estimate_cuda.tile_pages(64, 1) == 64 and estimate_cuda.tile_pages(64, 8) == 32
    # about estimate.cuda_target_programs (660) over the batch, at most one per tile of the
    # table
    options = KernelOptions()
    assert options.value("estimate.cuda_target_programs") == 660
    assert estimate_cuda.programs_per_row(32, 2048, 128, 4, options) == math.ceil(660 / 32)
    assert estimate_cuda.programs_per_row(256, 128, 128, 4, options) == 3
    assert estimate_cuda.programs_per_row(1, 10, 128, 4, options) == 1
    # however many rows, a row as long as the table gets programs of at most
    # estimate.cuda_max_tiles_per_program (8) tiles each
    assert estimate_cuda.programs_per_row(800, 2048, 128, 4, options) == 64 // 8
    fewer = KernelOptions(estimate="cuda", tuning={"estimate.cuda_target_programs": 32,
                                                   "estimate.cuda_max_tiles_per_program": 16})
    assert estimate_cuda.programs_per_row(32, 2048, 128, 4, fewer) == 64 // 16


def test_refusals_name_the_fix(monkeypatch):
    """An unknown backend; "cuda" where it cannot run (on the CPU: at the workspace);
    "auto" takes Triton's kernel where the CUDA one cannot run the call (warned)."""
    query, keys, _, summaries, table, seq_lens = estimate_inputs([65], 4, 64)
    log_masses = poisoned(2, 4, table.shape[1], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"KernelOptions.estimate must be one of \('auto', "
                                         r"'triton', 'cuda'\)"):
        KernelOptions(estimate="cutlass")
    with pytest.raises(ValueError, match="'estimate.cuda_target_programs' is read only by the "
                                         "cuda kernel"):
        KernelOptions(tuning={"estimate.cuda_target_programs": 100})
    monkeypatch.setattr(backends, "_warned", set())  # warned once per process otherwise
    workspace = workspace_for(query, keys, table,
                              tuning={"estimate.cuda_from_pages": table.shape[1]})
    assert workspace.backends["estimate"] == ("cuda" if ON_GPU else "triton")

    def picked(summaries=summaries, log_masses=log_masses):
        return backends.estimate(workspace, query, keys, summaries, table, seq_lens, None,
                                 log_masses)

    assert picked() == workspace.backends["estimate"]
    warned = pytest.warns(RuntimeWarning, match="estimate='auto' runs the Triton kernel.*"
                                                "bfloat16, got summaries") if ON_GPU \
        else contextlib.nullcontext()
    with warned:
        assert picked(summaries=summaries.float()) == "triton"
    assert picked(log_masses=log_masses[..., ::2]) == "triton"
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"KernelOptions\(estimate='cuda'\) cannot run "
                                             r"here: the tensors are on cpu"):
            workspace_for(query, keys, table, estimate="cuda")


@cuda
def test_unsupported_inputs_are_refused():
    query, keys, _, summaries, table, seq_lens = estimate_inputs([65, 300], 4, 64)
    log_masses = poisoned(4, 4, table.shape[1], dtype=torch.float32)
    rest = (table, seq_lens, 0.125, log_masses)
    with pytest.raises(ValueError, match="bfloat16, got summaries"):
        estimate(query, keys, summaries.float(), *rest)
    with pytest.raises(ValueError, match="bfloat16, got query"):
        estimate(query.half(), keys, summaries, *rest)
    wide = estimate_inputs([65], 16, 64, num_kv_heads=1)
    with pytest.raises(ValueError, match="at most 8"):
        estimate(wide[0], wide[1], wide[3], wide[4], wide[5], 0.125,
                 poisoned(1, 16, wide[4].shape[1], dtype=torch.float32))
    with pytest.raises(ValueError, match="int32"):
        estimate(query, keys, summaries, table.long(), seq_lens, 0.125, log_masses)


@cuda
@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", list(SEQ_LENS))
def test_cuda_estimate_matches_reference(group, head_dim, lengths):
    """One token, one full page, a partial second page, rows over several tiles; NaN where
    nothing may be written."""
    query, keys, _, summaries, table, seq_lens = estimate_inputs(SEQ_LENS[lengths], group,
                                                                  head_dim)
    log_masses = poisoned(len(seq_lens) * 2, group, table.shape[1], dtype=torch.float32)
    scale = 1.3 / math.sqrt(head_dim)
    estimate(query, keys, summaries, table, seq_lens, scale, log_masses)
    check_log_masses(log_masses, query, keys, summaries, table, seq_lens, scale)


@cuda
@pytest.mark.parametrize("target_programs", [1, 8, 24, 660])
@pytest.mark.parametrize("group, head_dim", [(4, 128), (8, 64), (1, 64)])
def test_programs_share_a_rows_tiles_in_a_wide_table(target_programs, group, head_dim):
    """As in an engine: the table far wider than the rows, each row's mvar programs (1 to
    several) looping over their share of the row's own tiles, some with none."""
    lengths = [64 * 70 + 5, 3, 64 * 100, 64 * 33, 64 * 2 + 1]
    query, keys, _, summaries, table, seq_lens = estimate_inputs(
        lengths, group, head_dim, num_pages=2100, extra_columns=300)
    log_masses = poisoned(len(lengths) * 2, group, table.shape[1], dtype=torch.float32)
    scale = 1 / math.sqrt(head_dim)
    estimate(query, keys, summaries, table, seq_lens, scale, log_masses,
             tuning={"estimate.cuda_target_programs": target_programs})
    check_log_masses(log_masses, query, keys, summaries, table, seq_lens, scale)


@cuda
@pytest.mark.parametrize("part", ["exact", "mvar"])
def test_parts_write_only_their_pages(part):
    """``estimate(parts=...)`` of the CUDA launcher (the timing probe of benchmarks/tune.py):
    "exact" writes each row's sink and current page as the whole kernel does and no middle
    page, "mvar" the middle pages and neither of those."""
    lengths = [64 * 70 + 5, 3, 64 * 100, 64 * 2 + 1]
    query, keys, _, summaries, table, seq_lens = estimate_inputs(lengths, 4, 128,
                                                                  num_pages=500)
    scale = 1 / math.sqrt(128)
    whole, partial = (poisoned(len(lengths) * 2, 4, table.shape[1], dtype=torch.float32)
                      for _ in range(2))
    estimate(query, keys, summaries, table, seq_lens, scale, whole)
    estimate(query, keys, summaries, table, seq_lens, scale, partial, parts=part)
    for b, length in enumerate(seq_lens.tolist()):
        last = ref.num_pages(length, table.shape[1]) - 1
        exact_pages = torch.zeros(table.shape[1], dtype=torch.bool)
        exact_pages[[0, last]] = True
        mine = exact_pages if part == "exact" else ~exact_pages
        mine[last + 1:] = False
        for row in (2 * b, 2 * b + 1):
            torch.testing.assert_close(partial[row][:, mine.to(DEVICE)],
                                       whole[row][:, mine.to(DEVICE)], rtol=0, atol=0)
            assert torch.isnan(partial[row][:, (~mine).to(DEVICE)]).all()


def test_parts_must_be_named():
    """A misspelt part is refused before anything runs (on the CPU too)."""
    with pytest.raises(ValueError, match="parts must be"):
        estimate_cuda.estimate(*[None] * 7, options=KernelOptions(estimate="cuda"),
                               parts="sink")


@cuda
@pytest.mark.parametrize("group, head_dim, layout", [(1, 64, "contiguous"), (4, 128, "packed"),
                                                     (7, 128, "hnd"), (8, 64, "contiguous")])
def test_new_tokens_written_and_filled_pages_summarized(group, head_dim, layout):
    """With ``new_kv`` the launch writes each row's token (a padded row's slot -1 writes
    nothing), summarizes a page the token filled (new key included), and estimates from the
    written cache; rows of at most ``dense_below_pages`` pages are written and summarized but
    not estimated."""
    lengths = [64 * 5, 64 * 3 + 1, 40, 64 * 4 + 17, 64, 0]
    query, keys, values, summaries, table, seq_lens = estimate_inputs(
        lengths, group, head_dim, num_pages=60, layout=layout)
    batch, num_kv_heads = len(lengths), keys.shape[2]
    summaries = ref.summarize(keys.cpu(), table.cpu(), (seq_lens - 1).clamp(min=0).cpu())
    summaries = summaries.to(torch.bfloat16).to(DEVICE)  # the pages full before the step
    new_keys, new_values = (torch.randn(batch, num_kv_heads, head_dim, device=DEVICE)
                            .to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([int(table[b, (n - 1) // 64]) * 64 + (n - 1) % 64 if n else -1
                          for b, n in enumerate(lengths)], dtype=torch.int64, device=DEVICE)
    expected_keys, expected_values = ref.write_tokens(keys.cpu(), values.cpu(), new_keys.cpu(),
                                                      new_values.cpu(), slots.cpu())
    scale = 1 / math.sqrt(head_dim)
    for dense_below_pages in (0, 4):
        k, v, s = keys.clone(), values.clone(), summaries.clone()
        log_masses = poisoned(batch * num_kv_heads, group, table.shape[1], dtype=torch.float32)
        estimate(query, k, s, table, seq_lens, scale, log_masses,
                 dense_below_pages=dense_below_pages, new_kv=(new_keys, new_values, v, slots))
        assert torch.equal(k.cpu(), expected_keys) and torch.equal(v.cpu(), expected_values)
        for b in (0, 4):  # the token filled page 4 of row 0, page 0 of row 4
            page = int(table[b, (lengths[b] - 1) // 64])
            filled = ref.summarize(expected_keys, table.cpu()[b:b + 1], seq_lens.cpu()[b:b + 1])
            torch.testing.assert_close(s[page].cpu().float(), filled[page],
                                       rtol=2 ** -7, atol=1e-6)
        others = torch.ones(s.shape[0], dtype=torch.bool, device=s.device)
        others[[int(table[0, 4]), int(table[4, 0])]] = False
        assert torch.equal(s[others], summaries[others])
        check_log_masses(log_masses, query, k, s, table, seq_lens, scale, dense_below_pages)


def test_auto_takes_the_cuda_kernel_from_a_table_width(monkeypatch):
    """"auto": the CUDA kernel for tables of at least ``estimate.cuda_from_pages`` pages
    (where it was timed faster), Triton's for narrower ones, on a device where both can run
    (a workspace that resolved the CUDA kernel, inputs it takes); "cuda" at any width."""
    query, keys, _, summaries, table, seq_lens = estimate_inputs([65], 4, 64)
    log_masses = poisoned(2, 4, table.shape[1], dtype=torch.float32)
    monkeypatch.setattr(estimate_cuda, "check_inputs", lambda *args: None)
    assert KernelOptions().estimate == "auto"
    for choice, threshold, picked in (("auto", table.shape[1], "cuda"),
                                      ("auto", table.shape[1] + 1, "triton"),
                                      ("cuda", table.shape[1] + 1, "cuda")):
        options = KernelOptions(estimate=choice,
                                tuning={"estimate.cuda_from_pages": threshold})
        workspace = SimpleNamespace(backends={"estimate": "cuda"},
                                    config=MoiraConfig(kernels=options))
        assert backends.estimate(workspace, query, keys, summaries, table, seq_lens, None,
                                 log_masses) == picked
