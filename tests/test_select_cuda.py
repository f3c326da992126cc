"""Select in CUDA C++ (``KernelOptions(select="cuda")``, moira/kernels/cuda/select.cu):
test_select.py's cases against the reference with this kernel (GPU only), the struct mirror
(CPU, given libnvrtc), the program's shape, the refusals and the choice by table width."""

import contextlib
from types import SimpleNamespace

import pytest
import test_select
import torch
from helpers import DEVICE, check_struct_mirror, needs_nvrtc

import moira
from moira import KernelOptions, MoiraConfig
from moira.config import MAX_PAGES_PER_SEQ
from moira.kernels import backends
from moira.kernels.cuda import build as cuda_build
from moira.kernels.cuda import select as select_cuda
from moira.kernels.triton import select as select_triton

cuda = pytest.mark.cuda
ON_GPU = DEVICE == "cuda" and cuda_build.nvrtc_library() is not None


def select_on_cuda(config):
    """test_select.py's ``run_select`` with the CUDA kernel, as a step under ``config`` (whose
    ``kernels`` set select="cuda") runs it: the workspace resolves the stage, the call's inputs
    are checked (the kernel's ValueError) and the launcher runs with K_B from
    ``config.bisection_ways``."""
    def run_select(log_masses, seq_lens, *, gamma=0.98, top_k=None, max_pages=None,
                   keep_fractions=None, gammas=None, dense_below_pages=0, options=None):
        del options  # the Triton Select's tuning (test_select.py's softmax forms): not this one
        batch, num_kv_heads, group, width = log_masses.shape
        max_pages = max_pages or width
        page_lists = torch.full((batch, num_kv_heads, width), -7, dtype=torch.int32,
                                device=DEVICE)
        page_counts = torch.full((batch, num_kv_heads), -7, dtype=torch.int32, device=DEVICE)
        log_masses = log_masses.to(DEVICE).view(batch * num_kv_heads, group, width)
        seq_lens = seq_lens.to(DEVICE)
        row_values, fractions, row_gammas = select_triton.row_values_of(
            None if keep_fractions is None else keep_fractions.to(DEVICE),
            None if gammas is None else gammas.to(DEVICE), page_counts)
        ways = config.bisection_ways_for(max_pages)
        workspace = moira.DecodeWorkspace(batch, width, num_kv_heads * group, num_kv_heads, 64,
                                          device=DEVICE, config=config)
        assert backends.select(workspace, log_masses, seq_lens, page_lists, page_counts,
                               max_pages, ways, row_values) == "cuda"
        select_cuda.select(log_masses, seq_lens, page_lists, page_counts,
                           num_kv_heads=num_kv_heads, max_pages=max_pages, gamma=gamma,
                           top_k=top_k, ways=ways, row_values=row_values, fractions=fractions,
                           row_gammas=row_gammas, dense_below_pages=dense_below_pages)
        return page_lists.cpu(), page_counts.cpu()

    return run_select


@pytest.fixture(params=["compared", "binned"])
def cuda_select(request, monkeypatch):
    """test_select.py's cases on the CUDA kernel with the default K_B schedule (each pass
    compares every page with every threshold) and with K_B = 64 at every width (each pass's
    sums from a histogram)."""
    config = MoiraConfig(kernels=KernelOptions(select="cuda"))
    if request.param == "binned":
        config = config.replace(bisection_ways=((MAX_PAGES_PER_SEQ, 64),))
    monkeypatch.setattr(test_select, "run_select", select_on_cuda(config))
    return request.param


@needs_nvrtc
def test_params_mirror_the_kernels_struct():
    """``select.Params`` (ctypes) mirrors the kernel's ``Params`` field by field."""
    check_struct_mirror(
        select_cuda.SOURCE, select_cuda.Params,
        retyped=(b"int num_kv_heads, max_pages, group, top_k",
                 b"int num_kv_heads, max_pages, group; float top_k; int", "top_k"),
        swapped=(b"int* page_lists;\n  int* page_counts;",
                 b"int* page_counts;\n  int* page_lists;"),
        options=("-DSELECT_P=1", "-DSELECT_WAYS=2"))


def test_program_shape_follows_the_table():
    """An eighth of the table's width in threads (32 to 512), the rest as pages per thread."""
    assert select_cuda.shape(10) == (32, 1) and select_cuda.shape(128) == (32, 4)
    assert select_cuda.shape(300) == (64, 8) and select_cuda.shape(2048) == (256, 8)
    assert select_cuda.shape(8192) == (512, 16) == select_cuda.shape(5000)
    assert select_cuda.max_table_pages(4) == 8192 and select_cuda.max_table_pages(8) == 4096
    assert select_cuda.max_table_pages(4, 64) == 4096 and select_cuda.max_table_pages(8, 64) == 2048


def test_refusals_name_the_fix(monkeypatch):
    """An unknown backend; "auto" takes Triton's kernel for tables narrower than
    ``select.cuda_from_pages`` and for calls the CUDA one cannot run (K_B, a table too wide
    for the group and K_B; warned); "cuda" raises where it cannot run (on the CPU: at the
    workspace)."""
    log_masses, seq_lens = test_select.random_log_masses([65, 64 * 9], 2, 4, 1.0)
    log_masses = log_masses.to(DEVICE).view(4, 4, -1)
    seq_lens = seq_lens.to(DEVICE)
    lists = torch.zeros(2, 2, log_masses.shape[-1], dtype=torch.int32, device=DEVICE)
    counts = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"KernelOptions.select must be one of \('auto', "
                                         r"'triton', 'cuda'\)"):
        KernelOptions(select="bisect")
    with pytest.raises(ValueError, match="'select.softmax_tile' is read only by the triton"):
        KernelOptions(select="cuda", tuning={"select.softmax_tile": 0})

    def workspace_for(**options):
        return moira.DecodeWorkspace(2, log_masses.shape[-1], 8, 2, 64, device=DEVICE,
                                     config=MoiraConfig(kernels=KernelOptions(**options)))

    assert workspace_for().backends["select"] == "triton"  # the default: Triton's Select
    monkeypatch.setattr(backends, "_warned", set())  # warned once per process otherwise
    workspace = workspace_for(select="auto", tuning={"select.cuda_from_pages": 9})
    assert workspace.backends["select"] == ("cuda" if ON_GPU else "triton")

    def picked(max_pages, ways, masses=log_masses):
        return backends.select(workspace, masses, seq_lens, lists, counts, max_pages, ways,
                               None)

    assert picked(9, 4) == workspace.backends["select"]
    warned = pytest.warns(RuntimeWarning, match="select='auto' runs the Triton kernel.*K_B") \
        if ON_GPU else contextlib.nullcontext()
    with warned:
        assert picked(9, 32) == "triton"  # K_B 32
    assert picked(8, 4) == "triton"  # narrower than 9
    assert picked(16384, 4) == "triton"  # too wide
    assert picked(8192, 64) == "triton"  # for K_B 64
    eight_heads = torch.zeros(2, 8, 16, device=DEVICE)  # 16 pages of 8 heads per thread spill
    assert picked(8192, 4, eight_heads) == "triton"
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"KernelOptions\(select='cuda'\) cannot run "
                                             r"here: the tensors are on cpu"):
            workspace_for(select="cuda")
    else:
        workspace = workspace_for(select="cuda")
        with pytest.raises(ValueError, match=r"KernelOptions\(select='cuda'\) is built for "
                                             r"K_B"):
            picked(9, 32)


@cuda
@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("spread", [0.3, 2.0, 8.0])
@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.98, 0.999])
def test_coverage_matches_reference(cuda_select, group, spread, gamma):
    test_select.test_coverage_matches_reference(group, spread, gamma)


@cuda
@pytest.mark.parametrize("gamma", [0.5, 0.98, 1.0])
def test_non_finite_estimates_are_kept(cuda_select, gamma):
    test_select.test_non_finite_estimates_are_kept_and_do_not_disturb_the_rest(gamma, 4)


@cuda
@pytest.mark.parametrize("top_k", [3, 17])
def test_non_finite_estimates_rank_first_under_a_fixed_count(cuda_select, top_k):
    test_select.test_non_finite_estimates_rank_first_under_a_fixed_count(top_k)


@cuda
@pytest.mark.parametrize("case", ["test_gamma_one_keeps_every_page_even_underflowing_ones",
                                  "test_one_page_holding_the_mass_is_kept_alone",
                                  "test_target_met_by_forced_pages_keeps_only_them",
                                  "test_fraction_mode_keeps_each_heads_share_of_every_row",
                                  "test_rows_clamped_to_block_table_width"])
def test_edge_cases(cuda_select, case):
    getattr(test_select, case)()


@cuda
@pytest.mark.parametrize("middle, edge, gamma", [
    ([5.0, 0.0], 0.0, 0.5), ([0.0] * 30, 0.0, 0.9), ([1.0, 2.0, 3.0], -50.0, 0.98)])
def test_top_page_alone_reaching_the_target_is_kept_alone(cuda_select, middle, edge, gamma):
    test_select.test_top_page_alone_reaching_the_target_is_kept_alone(middle, edge, gamma)


@cuda
@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.98])
def test_short_peaked_rows_match_reference(cuda_select, gamma):
    test_select.test_short_peaked_rows_match_reference(gamma)


@cuda
@pytest.mark.parametrize("top_k", [2, 3, 17, 64])
def test_fixed_count_keeps_exactly_k(cuda_select, top_k):
    test_select.test_fixed_count_keeps_exactly_k(top_k)


@cuda
@pytest.mark.parametrize("per_request", [False, True])
def test_coverage_with_a_target_per_row(cuda_select, per_request):
    test_select.test_coverage_with_a_target_per_row(per_request)


@cuda
@pytest.mark.parametrize("mode", [{"gamma": 0.5}, {"top_k": 3}])
def test_short_rows_keep_every_page(cuda_select, mode):
    test_select.test_short_rows_keep_every_page(mode)


@cuda
@pytest.mark.parametrize("pages", [2048, 4096, 8192])
def test_long_rows(cuda_select, pages):
    if cuda_select == "binned" and pages > select_cuda.max_table_pages(2, 64):
        with pytest.raises(ValueError, match="K_B = 64"):  # refused, not run
            test_select.test_long_rows(pages)
        return
    test_select.test_long_rows(pages)


def test_auto_takes_the_cuda_kernel_from_a_table_width(monkeypatch):
    """"auto": the CUDA kernel for tables of at least ``select.cuda_from_pages`` pages (where
    it was timed faster in a decode step), Triton's for narrower ones, on a device where both
    run (a workspace that resolved the CUDA kernel, inputs it takes); "cuda" at any width."""
    log_masses = torch.zeros(4, 4, 64, device=DEVICE)
    args = (log_masses, torch.ones(2, dtype=torch.int32, device=DEVICE),
            torch.zeros(2, 2, 64, dtype=torch.int32, device=DEVICE),
            torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))
    monkeypatch.setattr(select_cuda, "check_inputs", lambda *args: None)
    for choice, max_pages, picked in (("auto", 64, "cuda"), ("auto", 63, "triton"),
                                      ("cuda", 63, "cuda")):
        options = KernelOptions(select=choice, tuning={"select.cuda_from_pages": 64})
        workspace = SimpleNamespace(backends={"select": "cuda"},
                                    config=MoiraConfig(kernels=options))
        assert backends.select(workspace, *args, max_pages, 4, None) == picked
