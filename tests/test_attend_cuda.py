"""Attend in CUDA C++ (``attend.IMPLEMENTATION = "cuda"``, attend_cuda.cu) against the
reference: GPU only, except the struct mirror and the build (they need libnvrtc) and the
refusals. (List entries outside the block table: test_attend.py's test, with this
implementation as a case.)"""

from types import SimpleNamespace

import pytest
import torch
from helpers import (DEVICE, SMALL_SPLIT, check_struct_mirror, make_cache, make_query,
                     make_table, needs_nvrtc)
from test_attend import check_attend, mixed_rows, poison_unread_slots, random_lists

import moira
from moira import MoiraConfig
from moira.kernels import attend as attend_module
from moira.kernels import attend_cuda, cuda_build

cuda = pytest.mark.cuda


@pytest.fixture
def cuda_attend(monkeypatch):
    monkeypatch.setattr(attend_module, "IMPLEMENTATION", "cuda")
    return monkeypatch


@needs_nvrtc
def test_params_mirror_the_kernels_struct():
    """``attend_cuda.Params`` (ctypes) mirrors the kernel's ``Params`` (size, field names in
    order, types, the number of fields) and ``shared_bytes`` the kernel's layout: a field
    added, removed, retyped or reordered on one side only would pass the kernel garbage, and a
    launch with less shared memory than its layout would write past it."""
    shared = [f"static_assert(shared_bytes({d}, {s}) == {attend_cuda.shared_bytes(d, s)}, "
              f'"shared_bytes({d}, {s})");' for d in attend_cuda.HEAD_DIMS for s in (2, 3, 4)]
    check_struct_mirror(
        attend_cuda.SOURCE, attend_cuda.Params,
        retyped=(b"int num_kv_heads, max_pages, group, chunk_floor",
                 b"int num_kv_heads, max_pages, group; float chunk_floor; int", "chunk_floor"),
        swapped=(b"const bf16* key_cache;\n  const bf16* value_cache;",
                 b"const bf16* value_cache;\n  const bf16* key_cache;"),
        more_checks=shared)


def test_refusals_name_the_fix(cuda_attend):
    """What the CUDA Attend cannot run is a ValueError before any launch: another option of
    the Triton kernel, the balanced schedule, an unknown implementation, and (on the CPU)
    tensors not on a GPU."""
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows()
    args = (query, keys, values, table, seq_lens, page_lists, page_counts)
    cuda_attend.setattr(attend_module, "PAGE_IDS_AHEAD", True)
    with pytest.raises(ValueError, match="PAGE_IDS_AHEAD"):
        moira.attend(*args, config=SMALL_SPLIT)
    cuda_attend.setattr(attend_module, "PAGE_IDS_AHEAD", False)
    with pytest.raises(ValueError, match="schedule='rows'"):
        moira.attend(*args, config=SMALL_SPLIT.replace(schedule="balanced"))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="CUDA tensors"):
            moira.attend(*args, config=SMALL_SPLIT)
    cuda_attend.setattr(attend_module, "IMPLEMENTATION", "cutlass")
    with pytest.raises(ValueError, match="'auto', 'triton' or 'cuda'"):
        moira.attend(*args, config=SMALL_SPLIT)


def test_auto_runs_the_cuda_attend_where_it_can(monkeypatch):
    """"auto" (the default) resolves to the CUDA Attend on a GPU for bfloat16 at D = 64 / 128
    with the Triton kernel's options at their defaults, and to the Triton kernel for the CPU,
    float16, D = 96 or one of its options; "cuda" with such an option is refused."""
    assert attend_module.IMPLEMENTATION == "auto"
    on_gpu = DEVICE == "cuda" and cuda_build.nvrtc_library() is not None
    for head_dim in (64, 128):
        query, keys, values, *_ = mixed_rows(head_dim=head_dim)
        assert attend_module.implementation(query, keys, values) == ("cuda" if on_gpu
                                                                     else "triton")
    assert attend_module.implementation(query.half(), keys.half(), values.half()) == "triton"
    wide_keys, wide_values = make_cache(8, 2, 96)
    assert attend_module.implementation(make_query(2, 8, 96), wide_keys, wide_values) \
        == "triton"
    monkeypatch.setattr(attend_module, "EVEN_CHUNKS", True)
    assert attend_module.implementation(query, keys, values) == "triton"
    monkeypatch.setattr(attend_module, "IMPLEMENTATION", "cuda")
    with pytest.raises(ValueError, match="EVEN_CHUNKS"):
        attend_module.implementation(query, keys, values)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``attend_cuda.usable`` asked about a made-up GPU (its caches emptied around)."""
    properties = SimpleNamespace(major=9, shared_memory_per_block_optin=100 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    clear_device_caches()
    yield properties
    clear_device_caches()


def clear_device_caches():
    attend_cuda.usable.cache_clear()
    cuda_build.can_run.cache_clear()


def test_auto_needs_sm80_the_shared_memory_and_nvrtc(monkeypatch, fake_gpu):
    """Where "auto" cannot build or launch the CUDA Attend it takes the Triton kernel: a GPU
    older than sm_80, too little shared memory for the stages, no libnvrtc (warned)."""
    monkeypatch.setattr(cuda_build, "nvrtc_library", lambda: "libnvrtc.so.13")
    assert attend_cuda.usable(0, 128, 2)
    assert not attend_cuda.usable(0, 128, 4)  # 131 KB of stages, 100 KB allowed
    fake_gpu.major = 7
    clear_device_caches()  # their answers are per GPU, and this one changed
    assert not attend_cuda.usable(0, 64, 2)
    fake_gpu.major = 9
    monkeypatch.setattr(cuda_build, "nvrtc_library", lambda: None)
    clear_device_caches()
    with pytest.warns(RuntimeWarning, match="nvidia-cuda-nvrtc"):
        assert not attend_cuda.usable(0, 64, 2)


@cuda
def test_unsupported_inputs_are_refused(cuda_attend):
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows()
    args = (table, seq_lens, page_lists, page_counts)
    with pytest.raises(ValueError, match="bfloat16"):
        moira.attend(query.half(), keys.half(), values.half(), *args, config=SMALL_SPLIT)
    wide_query = make_query(query.shape[0], query.shape[1], 96)
    wide_keys, wide_values = make_cache(120, 2, 96)
    with pytest.raises(ValueError, match="head_dim"):
        moira.attend(wide_query, wide_keys, wide_values, *args, config=SMALL_SPLIT)
    cuda_attend.setattr(attend_module, "CUDA_STAGES", 5)
    with pytest.raises(ValueError, match="CUDA_STAGES"):
        moira.attend(query, keys, values, *args, config=SMALL_SPLIT)


@cuda
@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "packed", "hnd"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_cuda_attend_matches_reference(cuda_attend, group, head_dim, layout, stages):
    """Rows of one token, a partial second page, uneven chunks, full and empty rows, shuffled
    lists; split (Merge) and whole rows; NaN in every slot no row may read."""
    cuda_attend.setattr(attend_module, "CUDA_STAGES", stages)
    query, _, _, table, seq_lens, page_lists, page_counts = mixed_rows(group=group,
                                                                       head_dim=head_dim)
    keys, values = make_cache(120, 2, head_dim, layout=layout)
    poison_unread_slots(keys, values, table, seq_lens)
    for config in (SMALL_SPLIT, MoiraConfig()):
        check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config)


@cuda
@pytest.mark.parametrize("chunk_pages", [1000, 300])
def test_chunks_longer_than_the_staged_ids(cuda_attend, chunk_pages):
    """A chunk of more pages than the kernel stages at once (256): 625 pages in one chunk
    (three segments), or in chunks of 300 / 300 / 25 (a segment boundary inside a chunk)."""
    keys, values = make_cache(700, 1, 64)
    table, seq_lens = make_table([64 * 624 + 17], 700)
    query = make_query(1, 4, 64)
    page_lists, page_counts = random_lists(seq_lens.cpu(), 1, table.shape[1], fraction=1.0)
    page_lists[0, 0, :625] = torch.arange(625, dtype=torch.int32)
    page_counts[0, 0] = 625
    config = MoiraConfig(chunk_pages=chunk_pages, floor_rows=1, min_chunks_per_row=3,
                         min_programs=1, step_programs=0)
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts, config)


@cuda
def test_close_to_the_triton_kernel(monkeypatch):
    """The two implementations on the same inputs: equal within bf16 rounding of outputs that
    sum the same rounded weights in another order."""
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows(group=4,
                                                                               head_dim=128)
    args = (query, keys, values, table, seq_lens, page_lists, page_counts)
    monkeypatch.setattr(attend_module, "IMPLEMENTATION", "triton")
    triton_out = moira.attend(*args, config=SMALL_SPLIT)
    monkeypatch.setattr(attend_module, "IMPLEMENTATION", "cuda")
    cuda_out = moira.attend(*args, config=SMALL_SPLIT)
    torch.testing.assert_close(cuda_out.float(), triton_out.float(), rtol=0, atol=2e-2)


@cuda
def test_output_of_any_strides(cuda_attend):
    """``out`` a strided view (every other element of a wider buffer): each row written where
    its strides say, whole rows (direct writes) and split ones (Merge), nothing else touched."""
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows()
    args = (query, keys, values, table, seq_lens, page_lists, page_counts)
    for config in (SMALL_SPLIT, MoiraConfig()):
        wide = torch.full((*query.shape[:2], 2 * query.shape[2]), float("nan"),
                          dtype=query.dtype, device=DEVICE)
        moira.attend(*args, config=config, out=wide[..., ::2])
        torch.testing.assert_close(wide[..., ::2], moira.attend(*args, config=config),
                                   rtol=0, atol=0)
        assert torch.isnan(wide[..., 1::2]).all()


@cuda
def test_timeline_probe_records_every_program(cuda_attend):
    """``attend_cuda.TIMELINE`` (the probe's build): the same output as the default build, and
    every program of the grid writes its record (poisoned to -1 first): ordered times, a real
    SM, and page counts summing to the listed pages; a buffer of the wrong dtype is refused."""
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows(group=4,
                                                                               head_dim=128)
    args = (query, keys, values, table, seq_lens, page_lists, page_counts)
    expected = moira.attend(*args, config=SMALL_SPLIT)
    rows = page_counts.numel()
    timeline = torch.full((rows * 64, attend_cuda.TIMELINE_FIELDS), -1, dtype=torch.int64,
                          device=DEVICE)
    cuda_attend.setattr(attend_cuda, "TIMELINE", timeline)
    torch.testing.assert_close(moira.attend(*args, config=SMALL_SPLIT), expected, rtol=0, atol=0)
    written = timeline[timeline[:, 0] != -1].cpu()
    programs = len(written)
    assert programs >= rows and programs % rows == 0  # rows x chunks_per_row, row fastest
    assert (timeline[programs:] == -1).all()  # nothing past the grid
    start, first, end, start_clock, first_clock, end_clock, sm, pages = written.T
    assert (start > 0).all() and (end >= start).all() and (end_clock >= start_clock).all()
    working = pages > 0
    assert ((first[working] >= start[working]) & (first[working] <= end[working])).all()
    assert (first[~working] == 0).all()
    assert ((sm >= 0) & (sm < torch.cuda.get_device_properties(0).multi_processor_count)).all()
    assert int(pages.sum()) == int(page_counts.sum())
    cuda_attend.setattr(attend_cuda, "TIMELINE", timeline.int())
    with pytest.raises(ValueError, match="TIMELINE"):
        moira.attend(*args, config=SMALL_SPLIT)
