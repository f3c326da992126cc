"""Select in CUDA C++ (``select.IMPLEMENTATION = "cuda"``, select_cuda.cu): test_select.py's
cases against the reference with this kernel (GPU only), the struct mirror (CPU, given
libnvrtc) and the refusals."""

import pytest
import test_select
import torch
from helpers import DEVICE, check_struct_mirror, needs_nvrtc

from moira.config import MoiraConfig
from moira.kernels import cuda_build, select_cuda
from moira.kernels import select as select_module

cuda = pytest.mark.cuda


@pytest.fixture(params=["compared", "binned"])
def cuda_select(request, monkeypatch):
    """The CUDA kernel with the configured K_B (each pass compares every page with every
    threshold) and with K_B = 64 (each pass's sums from a histogram)."""
    monkeypatch.setattr(select_module, "IMPLEMENTATION", "cuda")
    if request.param == "binned":
        monkeypatch.setattr(MoiraConfig, "bisection_ways_for", lambda self, max_pages: 64)
    return request.param


@needs_nvrtc
def test_params_mirror_the_kernels_struct():
    """``select_cuda.Params`` (ctypes) mirrors the kernel's ``Params`` field by field."""
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
    log_masses, seq_lens = test_select.random_log_masses([65, 64 * 9], 2, 4, 1.0)
    log_masses = log_masses.to(DEVICE).view(4, 4, -1)
    seq_lens = seq_lens.to(DEVICE)
    lists = torch.zeros(2, 2, log_masses.shape[-1], dtype=torch.int32, device=DEVICE)
    counts = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    args = (log_masses, seq_lens, lists, counts)
    kwargs = dict(num_kv_heads=2, max_pages=log_masses.shape[-1], gamma=0.9, top_k=None,
                  ways=4)
    monkeypatch.setattr(select_module, "IMPLEMENTATION", "bisect")
    with pytest.raises(ValueError, match="'auto', 'triton' or 'cuda'"):
        select_module.select(*args, **kwargs)
    monkeypatch.setattr(select_module, "IMPLEMENTATION", "auto")
    monkeypatch.setattr(select_module, "CUDA_FROM_PAGES", 9)
    on_gpu = DEVICE == "cuda" and cuda_build.nvrtc_library() is not None
    assert select_module.implementation(*args, 9, 4, None) == ("cuda" if on_gpu else "triton")
    assert select_module.implementation(*args, 8, 4, None) == "triton"  # narrower than 9
    assert select_module.implementation(*args, 9, 32, None) == "triton"  # K_B 32
    assert select_module.implementation(*args, 16384, 4, None) == "triton"  # too wide
    assert select_module.implementation(*args, 8192, 64, None) == "triton"  # for K_B 64
    eight_heads = torch.zeros(2, 8, 16, device=DEVICE)  # 16 pages of 8 heads per thread spill
    assert select_module.implementation(eight_heads, *args[1:], 8192, 4, None) == "triton"
    monkeypatch.setattr(select_module, "IMPLEMENTATION", "cuda")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="CUDA tensors"):
            select_module.select(*args, **kwargs)
    else:
        with pytest.raises(ValueError, match="K_B"):
            select_module.select(*args, **dict(kwargs, ways=32))


@cuda
@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("spread", [0.3, 2.0, 8.0])
@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.98, 0.999])
def test_coverage_matches_reference(cuda_select, group, spread, gamma):
    test_select.test_coverage_matches_reference(group, spread, gamma)


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
@pytest.mark.parametrize("mode", [dict(gamma=0.5), dict(top_k=3)])
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
    """"auto": the CUDA kernel for tables of at least CUDA_FROM_PAGES pages (where it was
    timed faster in a decode step), Triton's for narrower ones, on a device where both run."""
    log_masses = torch.zeros(4, 4, 64, device=DEVICE)
    args = (log_masses, torch.ones(2, dtype=torch.int32, device=DEVICE),
            torch.zeros(2, 2, 64, dtype=torch.int32, device=DEVICE),
            torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))
    monkeypatch.setattr(select_module, "IMPLEMENTATION", "auto")
    monkeypatch.setattr(select_cuda, "check_inputs", lambda *args: None)
    monkeypatch.setattr(cuda_build, "can_run", lambda *args: True)
    monkeypatch.setattr(cuda_build, "device_index", lambda device: 0)
    monkeypatch.setattr(select_module, "CUDA_FROM_PAGES", 64)
    assert select_module.implementation(*args, 64, 4, None) == "cuda"
    assert select_module.implementation(*args, 63, 4, None) == "triton"
