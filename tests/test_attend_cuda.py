"""Attend in CUDA C++ (``KernelOptions(attend="cuda")``, moira/kernels/cuda/attend.cu) against
the reference: GPU only, except the struct mirror and the build (they need libnvrtc), the
refusals and the resolution on a made-up GPU. (List entries outside the block table:
test_attend.py's test, with this kernel as a case.)"""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from helpers import (DEVICE, SMALL_SPLIT, check_struct_mirror, make_cache, make_query,
                     make_table, needs_nvrtc)
from test_attend import check_attend, mixed_rows, poison_unread_slots, random_lists

import moira
from moira import KernelOptions, MoiraConfig
from moira.benchmarking import timeline as probes
from moira.kernels import backends
from moira.kernels.cuda import attend as attend_cuda
from moira.kernels.cuda import build as cuda_build

cuda = pytest.mark.cuda
ON_GPU = DEVICE == "cuda" and cuda_build.nvrtc_library() is not None


def on_cuda(config=SMALL_SPLIT, stages=None):
    """``config`` with Attend on the CUDA kernel (``attend.cuda_stages`` = ``stages`` if
    given)."""
    tuning = {} if stages is None else {"attend.cuda_stages": stages}
    return config.replace(kernels=KernelOptions(attend="cuda", tuning=tuning))


@pytest.fixture
def warn_anew(monkeypatch):
    """``backends`` warns once per process of each fallback: here, as if none had happened."""
    monkeypatch.setattr(backends, "_warned", set())


@needs_nvrtc
def test_params_mirror_the_kernels_struct():
    """``attend.Params`` (ctypes) mirrors the kernel's ``Params`` (size, field names in
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


def test_refusals_name_the_fix():
    """What the CUDA Attend cannot run is a ValueError before any launch: a tuning constant
    of the Triton kernel, stages it has no build for, one of its own constants without it,
    an unknown backend, the balanced schedule and (on the CPU) tensors not on a GPU."""
    with pytest.raises(ValueError, match="'attend.page_ids_ahead' is read only by the triton "
                                         "kernel, and attend='cuda'"):
        KernelOptions(attend="cuda", tuning={"attend.page_ids_ahead": True})
    with pytest.raises(ValueError, match=r"'attend.cuda_stages' must be one of \(2, 3, 4\)"):
        KernelOptions(attend="cuda", tuning={"attend.cuda_stages": 5})
    with pytest.raises(ValueError, match="'attend.cuda_stages' is read only by the cuda "
                                         "kernel, and attend='auto'"):
        KernelOptions(tuning={"attend.cuda_stages": 3})
    with pytest.raises(ValueError, match=r"KernelOptions.attend must be one of \('auto', "
                                         r"'triton', 'cuda'\)"):
        KernelOptions(attend="cutlass")
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows()
    args = (query, keys, values, table, seq_lens, page_lists, page_counts)
    reason = "schedule='balanced'" if ON_GPU else ""
    with pytest.raises(ValueError, match=rf"KernelOptions\(attend='cuda'\) cannot run here: "
                                         rf"{reason}"):
        moira.attend(*args, config=on_cuda(SMALL_SPLIT.replace(schedule="balanced")))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"KernelOptions\(attend='cuda'\) cannot run "
                                             r"here: the tensors are on cpu"):
            moira.attend(*args, config=on_cuda())


def test_auto_runs_the_cuda_attend_where_it_can(warn_anew):
    """"auto" (the default) resolves to the CUDA Attend on a GPU at D = 64 / 128 and to the
    Triton kernel on the CPU; per call, float16 runs the Triton kernel (warned) where the
    workspace resolved the CUDA one; a Triton tuning constant needs attend="triton"."""
    assert KernelOptions().attend == "auto"
    for head_dim in (64, 128):
        query, keys, values, table, *_ = mixed_rows(head_dim=head_dim)
        workspace = moira.DecodeWorkspace.for_step(query, keys, table, SMALL_SPLIT)
        assert workspace.backends["attend"] == ("cuda" if ON_GPU else "triton")
        assert backends.attend(workspace, query, keys, values) == workspace.backends["attend"]
    warned = pytest.warns(RuntimeWarning, match="attend='auto' runs the Triton kernel.*"
                                                "bfloat16") if ON_GPU \
        else contextlib.nullcontext()
    with warned:
        assert backends.attend(workspace, query.half(), keys.half(), values.half()) == "triton"
    even = SMALL_SPLIT.replace(kernels=KernelOptions(attend="triton",
                                                     tuning={"attend.even_chunks": True}))
    assert moira.DecodeWorkspace.for_step(query, keys, table, even).backends["attend"] \
        == "triton"
    with pytest.raises(ValueError, match="'attend.even_chunks' is read only by the triton"):
        KernelOptions(tuning={"attend.even_chunks": True})


@pytest.fixture
def fake_gpu(monkeypatch):
    """``attend_cuda.usable`` and the workspace's resolution asked about a made-up GPU (their
    caches emptied around)."""
    properties = SimpleNamespace(major=9, minor=0, shared_memory_per_block_optin=100 * 1024)
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


def test_a_workspace_resolves_attend_for_its_device_and_shapes(monkeypatch, fake_gpu):
    """``DecodeWorkspace.backends`` (``backends.resolve``) on a made-up sm_90 GPU with 100 KB
    of shared memory: the CUDA Attend under "auto" and "cuda" where it can run, and where it
    cannot (stages past the shared memory, the balanced schedule, a head dim or group it has
    no build for) the Triton kernel under "auto" and a ValueError naming why under "cuda"."""
    monkeypatch.setattr(cuda_build, "nvrtc_library", lambda: "libnvrtc.so.13")
    device = torch.device("cuda", 0)

    def attend_on(options, head_dim=128, group=4, schedule="rows"):
        return backends.resolve(options, device, head_dim, group, schedule)["attend"]

    assert attend_on(KernelOptions()) == "cuda" == attend_on(KernelOptions(attend="cuda"))
    assert attend_on(KernelOptions(attend="triton")) == "triton"
    with pytest.raises(ValueError, match="attend.cuda_stages=4 needs more shared memory"):
        attend_on(KernelOptions(attend="cuda", tuning={"attend.cuda_stages": 4}))
    assert attend_on(KernelOptions(attend="cuda", tuning={"attend.cuda_stages": 4}),
                     head_dim=64) == "cuda"  # 67 KB at D = 64
    for shape, reason in (({"schedule": "balanced"}, "the 'rows' schedule"),
                          ({"head_dim": 96}, "head_dim 96"),
                          ({"group": 17}, "at most 16")):
        assert attend_on(KernelOptions(), **shape) == "triton"
        with pytest.raises(ValueError, match=rf"KernelOptions\(attend='cuda'\) cannot run "
                                             rf"here: .*{reason}"):
            attend_on(KernelOptions(attend="cuda"), **shape)


@cuda
def test_unsupported_inputs_are_refused(warn_anew):
    """Per call, under attend="cuda": float16 and a cache whose strides break the 16-byte
    copies are the kernel's ValueErrors (a head dim without a kernel is refused for every
    backend); under "auto" the same calls run the Triton kernel, warned."""
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows()
    args = (table, seq_lens, page_lists, page_counts)
    with pytest.raises(ValueError, match=r"KernelOptions\(attend='cuda'\) reads bfloat16"):
        moira.attend(query.half(), keys.half(), values.half(), *args, config=on_cuda())
    # a head dim of 65 elements between tokens: rows aligned to 2 bytes only
    odd_keys = torch.cat([keys, keys[..., :1]], dim=-1)[..., :keys.shape[-1]]
    with pytest.raises(ValueError, match="aligned to 16 bytes"):
        moira.attend(query, odd_keys, values, *args, config=on_cuda())
    with pytest.warns(RuntimeWarning, match="attend='auto' runs the Triton kernel"):
        check_attend(query, odd_keys, values, *args, SMALL_SPLIT)
    check_attend(query.half(), keys.half(), values.half(), *args, SMALL_SPLIT)
    wide_query = make_query(query.shape[0], query.shape[1], 96)
    wide_keys, wide_values = make_cache(120, 2, 96)
    with pytest.raises(ValueError, match="head_dim 96"):
        moira.attend(wide_query, wide_keys, wide_values, *args, config=on_cuda())


@cuda
@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "packed", "hnd"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_cuda_attend_matches_reference(group, head_dim, layout, stages):
    """Rows of one token, a partial second page, uneven chunks, full and empty rows, shuffled
    lists; split (Merge) and whole rows; NaN in every slot no row may read."""
    query, _, _, table, seq_lens, page_lists, page_counts = mixed_rows(group=group,
                                                                       head_dim=head_dim)
    keys, values = make_cache(120, 2, head_dim, layout=layout)
    poison_unread_slots(keys, values, table, seq_lens)
    for config in (SMALL_SPLIT, MoiraConfig()):
        check_attend(query, keys, values, table, seq_lens, page_lists, page_counts,
                     on_cuda(config, stages))


@cuda
@pytest.mark.parametrize("chunk_pages", [1000, 300])
def test_chunks_longer_than_the_staged_ids(chunk_pages):
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
    check_attend(query, keys, values, table, seq_lens, page_lists, page_counts,
                 on_cuda(config))


@cuda
def test_close_to_the_triton_kernel():
    """The two kernels on the same inputs: equal within bf16 rounding of outputs that sum the
    same rounded weights in another order."""
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows(group=4,
                                                                               head_dim=128)
    args = (query, keys, values, table, seq_lens, page_lists, page_counts)
    triton_config = SMALL_SPLIT.replace(kernels=KernelOptions(attend="triton"))
    triton_out = moira.attend(*args, config=triton_config)
    cuda_out = moira.attend(*args, config=on_cuda())
    torch.testing.assert_close(cuda_out.float(), triton_out.float(), rtol=0, atol=2e-2)


@cuda
def test_output_of_any_strides():
    """``out`` a strided view (every other element of a wider buffer): each row written where
    its strides say, whole rows (direct writes) and split ones (Merge), nothing else touched."""
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows()
    args = (query, keys, values, table, seq_lens, page_lists, page_counts)
    for config in (on_cuda(), on_cuda(MoiraConfig())):
        wide = torch.full((*query.shape[:2], 2 * query.shape[2]), float("nan"),
                          dtype=query.dtype, device=DEVICE)
        moira.attend(*args, config=config, out=wide[..., ::2])
        torch.testing.assert_close(wide[..., ::2], moira.attend(*args, config=config),
                                   rtol=0, atol=0)
        assert torch.isnan(wide[..., 1::2]).all()


@cuda
def test_timeline_probe_records_every_program():
    """``timeline.recording("attend", ...)`` (the probe's build): the same output as the
    default build, and every program of the grid writes its record (poisoned to -1 first):
    ordered times, a real SM, and page counts summing to the listed pages; a buffer of the
    wrong dtype is refused."""
    query, keys, values, table, seq_lens, page_lists, page_counts = mixed_rows(group=4,
                                                                               head_dim=128)
    args = (query, keys, values, table, seq_lens, page_lists, page_counts)
    expected = moira.attend(*args, config=on_cuda())
    rows = page_counts.numel()
    timeline = torch.full((rows * 64, probes.FIELDS), -1, dtype=torch.int64, device=DEVICE)
    with probes.recording("attend", timeline):
        torch.testing.assert_close(moira.attend(*args, config=on_cuda()), expected, rtol=0,
                                   atol=0)
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
    with probes.recording("attend", timeline.int()), \
            pytest.raises(ValueError, match="attend timeline must be a contiguous int64"):
        moira.attend(*args, config=on_cuda())
