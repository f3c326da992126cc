"""Estimate and Select in one launch (``KernelOptions.fused``,
moira/kernels/cuda/estimate_select.cu): on a GPU the fused kernel's lists, counts, cache
writes, summaries and outputs equal the two kernels' bit for bit (the same arithmetic;
Select's sums in another order outside tables of 1,025-2,048 pages, which these seeded inputs
do not tie on), in every mode and on edge rows, eagerly and in a CUDA graph; on the CPU, the
struct mirror (given libnvrtc) and when the step takes it."""

import ctypes

import pytest
import torch
from helpers import DEVICE, make_cache, make_query, make_table, needs_nvrtc, poisoned

import moira
from moira import KernelOptions, MoiraConfig
from moira import reference as ref
from moira.benchmarking import timeline as probes
from moira.kernels.cuda import build as cuda_build
from moira.kernels.cuda import estimate_select as estimate_select_cuda

cuda = pytest.mark.cuda


@needs_nvrtc
def test_params_mirror_the_kernels_struct():
    """``estimate_select.Params`` (ctypes) is the kernel's: the two kernels' own structs
    (each mirror-tested in its own test file), the shared row width and the probe's pointer,
    in that order and size; a kernel whose fields were swapped fails the same checks."""
    with open(cuda_build.source_path(estimate_select_cuda.SOURCE), "rb") as f:
        source = f.read()
    checks = "\n".join([
        "template <class A, class B> struct same { static constexpr bool value = false; };",
        "template <class A> struct same<A, A> { static constexpr bool value = true; };",
        f'static_assert(sizeof(Params) == {ctypes.sizeof(estimate_select_cuda.Params)}, "size");',
        'static_assert(same<decltype(Params::estimate), est::Params>::value, "estimate");',
        'static_assert(same<decltype(Params::select), sel::Params>::value, "select");',
        'static_assert(same<decltype(Params::masses_stride), int>::value, "masses_stride");',
        'static_assert(same<decltype(Params::timeline), unsigned long long*>::value, "timeline");',
        "__device__ Params in_order{.estimate = {}, .select = {}, .masses_stride = 0,"
        " .timeline = nullptr};"])
    assert [name for name, _ in estimate_select_cuda.Params._fields_] == [
        "estimate", "select", "masses_stride", "timeline"]
    cuda_build.compile_cubin(source + b"\n" + checks.encode(), "90", ["-std=c++20"])
    swapped = source.replace(b"  est::Params estimate;\n  sel::Params select;",
                             b"  sel::Params select;\n  est::Params estimate;")
    assert swapped != source
    with pytest.raises(RuntimeError, match="out-of-order initializers|size"):
        cuda_build.compile_cubin(swapped + b"\n" + checks.encode(), "90", ["-std=c++20"])


def test_applies_follows_the_setting_rows_and_table(monkeypatch):
    """fused="auto" from ``fused.min_rows`` rows in tables of ``fused.min_table_pages``, "on"
    at any, "off" never; never past Select's per-thread limit on 256 threads, the
    shared-memory budget or with programmatic launch; an unknown setting is refused by
    name."""
    applies = estimate_select_cuda.applies
    automatic = KernelOptions()
    assert automatic.fused == "auto"
    rows = automatic.value("fused.min_rows")
    assert applies(rows, 2048, 4, 4, False, automatic)
    assert not applies(rows - 1, 2048, 4, 4, False, automatic)
    assert automatic.value("fused.min_table_pages") == 2048
    assert not applies(rows, 2047, 4, 4, False, automatic)
    options = KernelOptions(tuning={"fused.min_table_pages": 1})
    assert not applies(rows, 2048, 4, 4, True, options)  # programmatic launch: two kernels
    assert not applies(rows, 4097, 4, 4, False, options)  # past 16 pages per thread
    assert applies(rows, 2048, 8, 4, False, options)
    assert not applies(rows, 2049, 8, 4, False, options)
    assert not applies(rows, 2048, 8, 64, False, options)  # K_B 64's limit at G = 8: 4 per thread
    fewer = KernelOptions(tuning={"fused.min_rows": 3, "fused.min_table_pages": 1})
    assert applies(3, 9, 4, 4, False, fewer) and not applies(2, 9, 4, 4, False, fewer)
    monkeypatch.setattr(estimate_select_cuda, "MAX_SHARED", 16 * 1024)
    assert not applies(rows, 2048, 4, 4, False, options)
    assert applies(rows, 1024, 4, 4, False, options)
    assert applies(1, 1024, 4, 4, False, KernelOptions(fused="on"))
    assert not applies(1, 1024, 4, 4, True, KernelOptions(fused="on"))
    assert not applies(rows, 1024, 4, 4, False, KernelOptions(fused="off"))
    with pytest.raises(ValueError, match=r"KernelOptions.fused must be one of \('auto', 'on', "
                                         r"'off'\), got 'yes'"):
        KernelOptions(fused="yes")
    assert estimate_select_cuda.pages_per_thread(2033) == 8
    assert estimate_select_cuda.pages_per_thread(100) == 1


def test_the_step_launches_it_where_the_cuda_estimate_runs(monkeypatch):
    """A step takes the fused launch exactly when ``applies`` holds, the Estimate resolves to
    CUDA and the CUDA Select could take the inputs (whichever Select ``KernelOptions.select``
    names: the fused kernel replaces it): not under the interpreter (the workspace resolves
    fused="off" there), nor where "auto" picks Triton's Estimate (a table narrower than
    ``estimate.cuda_from_pages``)."""
    calls = []
    real = estimate_select_cuda.estimate_select
    monkeypatch.setattr(estimate_select_cuda, "estimate_select",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    num_kv_heads, group, head_dim = 2, 4, 64
    keys, values = make_cache(24, num_kv_heads, head_dim)
    table, seq_lens = make_table([64 * 5 + 3, 64 * 2], 24)
    query = make_query(2, num_kv_heads * group, head_dim)
    summaries = moira.summarize(keys, table, seq_lens)

    def step(**options):
        config = MoiraConfig(kernels=KernelOptions(**options))
        workspace = moira.DecodeWorkspace.for_step(query, keys, table, config)
        moira.sparse_decode(query, keys, values, summaries, table, seq_lens, gamma=0.9,
                            workspace=workspace)
        return workspace.backends

    resolved = step(fused="on")  # "auto": Triton's Estimate in a 7-page table
    assert calls == []
    if DEVICE == "cuda" and cuda_build.nvrtc_library() is not None:
        assert resolved["estimate"] == "cuda" and resolved["fused"] == "on"
        step(estimate="cuda", select="triton", fused="on")
        assert calls == [1]
        step(estimate="cuda", select="triton", fused="off")
        assert calls == [1]
    else:
        assert resolved["estimate"] == "triton" and resolved["fused"] == "off"


LENGTHS = [1, 64, 65, 128, 64 * 9, 64 * 9 + 1, 0, 64 * 40 + 17, 64 * 3 + 63]


def step_inputs(group, head_dim, lengths=LENGTHS, num_kv_heads=2, extra_columns=3,
                layout="packed"):
    """One step's ``(query, keys, values, summaries, table, seq_lens)`` on a cache just large
    enough for distinct pages."""
    width = max(1, -(-max(lengths) // 64)) + extra_columns
    keys, values = make_cache(len(lengths) * width, num_kv_heads, head_dim, layout=layout)
    table, seq_lens = make_table(lengths, len(lengths) * width, extra_columns=extra_columns)
    query = make_query(len(lengths), num_kv_heads * group, head_dim)
    # the pages full before this step's tokens, their variances scaled up so mvar's second
    # term matters
    summaries = moira.summarize(keys, table, (seq_lens - 1).clamp(min=0),
                                torch.zeros(keys.shape[0], num_kv_heads, 2, head_dim,
                                            device=DEVICE, dtype=torch.bfloat16))
    summaries[..., 1, :] *= 1 + torch.rand_like(summaries[..., 1, :])
    return query, keys, values, summaries, table, seq_lens


def run_step(monkeypatch, fused, inputs, new_tokens=True, graph=False, **call):
    """The step's (keys, values, summaries, out, lists, counts) with the fused launch "on" or
    "off" (then the two CUDA kernels: "auto" would pick Triton's in these narrow tables),
    from copies of ``inputs`` (each run writes its caches), its outputs poisoned; ``call``:
    more keywords of ``sparse_decode``."""
    kernels = KernelOptions(estimate="cuda", select="cuda", fused="on" if fused else "off")
    calls = []
    real = estimate_select_cuda.estimate_select
    monkeypatch.setattr(estimate_select_cuda, "estimate_select",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    query, keys, values, summaries, table, seq_lens = inputs
    keys, values, summaries = keys.clone(), values.clone(), summaries.clone()
    batch, num_kv_heads, head_dim = query.shape[0], keys.shape[2], query.shape[2]
    new_kv = {}
    if new_tokens:
        generator = torch.Generator(device=DEVICE).manual_seed(7)
        new_keys, new_values = (torch.randn(batch, num_kv_heads, head_dim, device=DEVICE,
                                            generator=generator).to(keys.dtype)
                                for _ in range(2))
        slots = torch.tensor([int(table[b, (n - 1) // 64]) * 64 + (n - 1) % 64 if n else -1
                              for b, n in enumerate(seq_lens.tolist())], dtype=torch.int64,
                             device=DEVICE)
        new_kv = dict(new_keys=new_keys, new_values=new_values, slot_mapping=slots)
    workspace = moira.DecodeWorkspace(batch, table.shape[1], query.shape[1], num_kv_heads,
                                      head_dim, device=DEVICE,
                                      config=MoiraConfig(kernels=kernels))
    workspace.page_lists.fill_(-7)
    workspace.page_counts.fill_(-7)
    out = poisoned(*query.shape)

    def step():
        return moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                   workspace=workspace, out=out, return_pages=True, **new_kv,
                                   **call)

    if graph:  # built eagerly (on copies), then captured and replayed on the real inputs
        saved = [t.clone() for t in (keys, values, summaries)]
        step()
        for t, s in zip((keys, values, summaries), saved):
            t.copy_(s)
        workspace.page_lists.fill_(-7)
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            _, lists, counts = step()
        captured.replay()
        torch.cuda.synchronize()
    else:
        _, lists, counts = step()
    assert bool(calls) == fused  # the path under test ran
    monkeypatch.setattr(estimate_select_cuda, "estimate_select", real)
    return keys, values, summaries, out, lists.clone(), counts.clone()


def assert_same_step(fused, two):
    keys, values, summaries, out, lists, counts = fused
    keys0, values0, summaries0, out0, lists0, counts0 = two
    assert torch.equal(keys, keys0) and torch.equal(values, values0)
    assert torch.equal(summaries, summaries0)
    assert torch.equal(counts, counts0) and (counts >= 0).all()
    for b in range(counts.shape[0]):
        for h in range(counts.shape[1]):
            n = int(counts[b, h])
            assert torch.equal(lists[b, h, :n], lists0[b, h, :n])
    assert torch.equal(out, out0) and not torch.isnan(out.float()).any()


MODES = {"gamma": dict(gamma=0.9), "gamma_one": dict(gamma=1.0), "top_k": dict(top_k=5),
         "dense_below": dict(gamma=0.9, dense_below_pages=9)}


@cuda
@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 128), (7, 128), (8, 64), (4, 64)])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_fused_equals_the_two_kernels(monkeypatch, group, head_dim, mode):
    """Every mode, on rows of one token, one and two full pages, a partial page, a padded
    row and a 41-page row, with this step's tokens written: caches, summaries, lists, counts
    and outputs equal bit for bit; the lists are the reference's (its float32 log-masses)."""
    inputs = step_inputs(group, head_dim)
    fused = run_step(monkeypatch, True, inputs, **MODES[mode])
    assert_same_step(fused, run_step(monkeypatch, False, inputs, **MODES[mode]))
    if mode == "gamma":
        keys, _, summaries, _, lists, counts = fused
        query, _, _, _, table, seq_lens = inputs
        expected_lists, expected_counts = ref.select(
            ref.estimate(*[t.cpu() for t in (query, keys, summaries, table, seq_lens)]),
            seq_lens.cpu(), gamma=0.9)
        assert torch.equal(counts.cpu(), expected_counts)


@cuda
@pytest.mark.parametrize("per", ["kv_head", "row"])
def test_fused_equals_the_two_kernels_with_values_per_row(monkeypatch, per):
    """Keep fractions and coverage targets per KV head or per (request, KV head)."""
    inputs = step_inputs(4, 128)
    shape = (2,) if per == "kv_head" else (len(LENGTHS), 2)
    fractions = torch.rand(shape, device=DEVICE) * 0.6 + 0.05
    gammas = torch.rand(shape, device=DEVICE) * 0.2 + 0.79
    for call in ({"keep_fractions": fractions}, {"gamma": gammas}):
        assert_same_step(run_step(monkeypatch, True, inputs, **call),
                         run_step(monkeypatch, False, inputs, **call))


@cuda
@pytest.mark.parametrize("columns", [1, 2048 - 42])
def test_fused_equals_the_two_kernels_in_wide_tables(monkeypatch, columns):
    """A table as wide as an engine's (2,048 pages: 8 pages per thread, 32 KB of log-masses
    at G = 4) and one column past the longest row, without new tokens."""
    inputs = step_inputs(4, 128, lengths=[64 * 9 + 1, 64 * 40 + 17, 1, 64],
                         extra_columns=columns)
    assert_same_step(run_step(monkeypatch, True, inputs, new_tokens=False, gamma=0.95),
                     run_step(monkeypatch, False, inputs, new_tokens=False, gamma=0.95))


@cuda
def test_many_rows_in_a_cuda_graph(monkeypatch):
    """128 rows of random lengths up to 6,400 tokens, captured in a CUDA
    graph and replayed: the same as the two kernels run eagerly."""
    lengths = torch.randint(1, 64 * 100, (64,)).tolist()
    inputs = step_inputs(4, 128, lengths=lengths, extra_columns=1)
    assert_same_step(run_step(monkeypatch, True, inputs, graph=True, gamma=0.98),
                     run_step(monkeypatch, False, inputs, gamma=0.98))


@cuda
def test_timeline_probe_records_every_program(monkeypatch):
    """The probe's build (``timeline.recording("estimate_select", ...)``) computes the same
    step and every program writes its marks in order."""
    inputs = step_inputs(4, 128)
    rows = len(LENGTHS) * 2
    timeline = torch.full((rows, probes.FIELDS), -1, dtype=torch.int64, device=DEVICE)
    with probes.recording("estimate_select", timeline):
        probed = run_step(monkeypatch, True, inputs, gamma=0.9)
    assert_same_step(probed, run_step(monkeypatch, False, inputs, gamma=0.9))
    t = timeline.cpu()
    assert (t[:, [0, 1, 6, 7]] > 0).all()
    assert (t[:, 1] >= t[:, 0]).all() and (t[:, 7] >= t[:, 6]).all() and (t[:, 6] >= t[:, 1]).all()
    estimated = [b * 2 + h for b, n in enumerate(LENGTHS) for h in range(2) if n > 64]
    assert (t[estimated][:, 2:6] > 0).all()  # both groups' marks where both computed
