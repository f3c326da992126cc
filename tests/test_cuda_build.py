"""The NVRTC build and its cache (``moira.kernels.cuda.build``), the driver launch, and how a
stage's ``KernelOptions`` choice meets what a call's inputs allow (``moira.kernels.backends``):
no GPU needed (the builds need a libnvrtc)."""

import contextlib
import ctypes
import os
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import SMALL_SPLIT, make_cache, make_query, make_table, needs_nvrtc

import moira
from moira import KernelOptions, MoiraConfig
from moira.kernels import backends
from moira.kernels.cuda import attend as attend_cuda
from moira.kernels.cuda import build as cuda_build
from moira.kernels.cuda import estimate as estimate_cuda
from moira.kernels.cuda import select as select_cuda


@pytest.fixture(autouse=True)
def _fresh_build_state(monkeypatch):
    """Each test warns anew and remembers no earlier test's failed builds."""
    monkeypatch.setattr(cuda_build, "_warned", set(), raising=False)
    monkeypatch.setattr(cuda_build, "_failed", {}, raising=False)
    monkeypatch.setattr(backends, "_warned", set())


@needs_nvrtc
def test_build_is_cached_by_source(tmp_path, monkeypatch):
    """One NVRTC build per source, architecture and NVRTC version: the second call reads the
    cached cubin, and a changed source is built anew."""
    monkeypatch.setenv("MOIRA_CACHE_DIR", str(tmp_path / "cache"))
    image = cuda_build.build("attend.cu", "90")
    assert image[:4] == b"\x7fELF" and b"moira_attend_d128_s2" in image
    assert os.listdir(tmp_path / "cache")[0].startswith("attend-sm90-")
    compile_cubin = cuda_build.compile_cubin
    monkeypatch.setattr(cuda_build, "compile_cubin", None)  # a second build would fail
    assert cuda_build.build("attend.cu", "90") == image
    changed = tmp_path / "attend.cu"
    with open(cuda_build.source_path("attend.cu")) as f:
        changed.write_text(f.read() + "\n// changed\n")
    real_path = cuda_build.source_path
    monkeypatch.setattr(cuda_build, "source_path", lambda file_name: str(changed)
                        if file_name == "attend.cu" else real_path(file_name))
    monkeypatch.setattr(cuda_build, "compile_cubin", compile_cubin)
    cuda_build.build("attend.cu", "90")
    assert len(os.listdir(tmp_path / "cache")) == 2
    # a changed header (what the sources include) is a changed build too
    header = tmp_path / "common.cuh"
    with open(real_path("common.cuh")) as f:
        header.write_text(f.read() + "\n// changed\n")
    monkeypatch.setattr(cuda_build, "source_path", lambda file_name: str(
        {"attend.cu": changed, "*.cuh": header}.get(file_name) or real_path(file_name)))
    cuda_build.build("attend.cu", "90")
    assert len(os.listdir(tmp_path / "cache")) == 3


@needs_nvrtc
def test_a_compile_error_names_the_file_and_the_line():
    with pytest.raises(RuntimeError, match=r"broken\.cu.*sm_90(.|\n)*broken\.cu\(1\)"):
        cuda_build.compile_cubin(b"this is not C++;\n", "90", name="broken.cu")


def test_launch_passes_the_drivers_arguments_in_order(monkeypatch):
    """cuLaunchKernel(f, grid x, y, z, block x, y, z, shared bytes, stream, params, extra),
    with the structure's address as the one kernel argument (checked without a GPU: a wrong
    count or order is found only by launching otherwise)."""
    calls = []
    fake = SimpleNamespace(cuLaunchKernel=lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(cuda_build, "driver", lambda: fake)
    monkeypatch.setattr(cuda_build, "make_current", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: SimpleNamespace(cuda_stream=1234))
    params = ctypes.c_int(7)
    cuda_build.launch("kernel", (5, 3), 128, 4096, torch.device("cuda", 0), params)
    (args,) = calls
    assert args[:8] == ("kernel", 5, 3, 1, 128, 1, 1, 4096)
    assert args[8].value == 1234 and args[10] is None
    assert args[9][0] == ctypes.addressof(params)


def test_a_gpu_older_than_sm80_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    with pytest.raises(ValueError, match=r"KernelOptions\(select='cuda'\) needs sm_80.*sm_75"):
        cuda_build.function(0, "select.cu", "moira_select_p8_w4_g4", "select")


def stand_in_workspace(backend, choice):
    """What ``backends.attend`` reads of a workspace: the stage as resolved for its device
    (``backend``) and as configured (``choice``)."""
    return SimpleNamespace(backends={"attend": backend},
                           config=MoiraConfig(kernels=KernelOptions(attend=choice)))


def test_a_call_falls_back_only_under_auto(monkeypatch):
    """Per call, where the workspace resolved the CUDA kernel: "cuda" raises the kernel's check
    error; "auto" runs the Triton kernel for inputs the check refuses (warned once) and the
    CUDA one for inputs it passes; a workspace resolved to Triton asks nothing; a choice
    that is not a backend is refused by ``KernelOptions``."""
    def refuse(*args):
        raise ValueError("KernelOptions(attend='cuda') reads bfloat16, got query "
                         "torch.float16: use 'triton'")

    def unreachable(*args):
        raise AssertionError("asked")

    monkeypatch.setattr(backends, "_warned", set())  # warned once per process otherwise
    call = (torch.zeros(1, 4, 64), torch.zeros(1, 64, 1, 64), torch.zeros(1, 64, 1, 64))
    monkeypatch.setattr(attend_cuda, "check_inputs", unreachable)
    for choice in ("auto", "triton"):
        assert backends.attend(stand_in_workspace("triton", choice), *call) == "triton"
    monkeypatch.setattr(attend_cuda, "check_inputs", refuse)
    with pytest.raises(ValueError, match="reads bfloat16"):
        backends.attend(stand_in_workspace("cuda", "cuda"), *call)
    with pytest.warns(RuntimeWarning, match="attend='auto' runs the Triton kernel.*bfloat16"):
        assert backends.attend(stand_in_workspace("cuda", "auto"), *call) == "triton"
    monkeypatch.setattr(attend_cuda, "check_inputs", lambda *args: None)
    for choice in ("auto", "cuda"):
        assert backends.attend(stand_in_workspace("cuda", choice), *call) == "cuda"
    with pytest.raises(ValueError, match=r"KernelOptions.attend must be one of \('auto', "
                                         r"'triton', 'cuda'\), got 'fast'"):
        KernelOptions(attend="fast")


@pytest.fixture
def made_up_gpu(monkeypatch):
    """An sm_75 GPU as ``torch.cuda`` describes it to the resolution, with libnvrtc
    (``usable``'s cached answers emptied around: they are per device, and this one is made
    up)."""
    gpu = SimpleNamespace(major=7, minor=5, shared_memory_per_block_optin=227 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (gpu.major,
                                                                            gpu.minor))
    monkeypatch.setattr(cuda_build, "unusable", lambda index: None)
    attend_cuda.usable.cache_clear()
    cuda_build.can_run.cache_clear()
    yield gpu
    attend_cuda.usable.cache_clear()
    cuda_build.can_run.cache_clear()


def test_a_workspace_refuses_an_explicit_cuda_the_device_cannot_run(monkeypatch, made_up_gpu):
    """Resolved once per workspace: a GPU older than sm_80 or one without libnvrtc takes the
    Triton kernels under "auto", and an explicit "cuda" is a ValueError naming the stage, the
    reason and the fix."""
    gpu = made_up_gpu
    device = torch.device("cuda", 0)
    automatic = backends.resolve(KernelOptions(estimate="auto", select="auto"), device, 128, 4,
                                 "rows")
    assert automatic == {"estimate": "triton", "select": "triton", "attend": "triton",
                         "fused": "off"}
    for stage in ("estimate", "select", "attend"):
        with pytest.raises(ValueError, match=rf"KernelOptions\({stage}='cuda'\) cannot run "
                                             rf"here: the GPU is sm_75.*{stage}='auto' or "
                                             rf"'triton'"):
            backends.resolve(KernelOptions(**{stage: "cuda"}), device, 128, 4, "rows")
    gpu.major, gpu.minor = 9, 0
    assert backends.resolve(KernelOptions(estimate="cuda", select="cuda", attend="cuda"),
                            device, 128, 4, "rows") == {"estimate": "cuda", "select": "cuda",
                                                        "attend": "cuda", "fused": "auto"}
    monkeypatch.setattr(cuda_build, "unusable",  # no libnvrtc
                        lambda index: "no libnvrtc was found (pip install nvidia-cuda-nvrtc)")
    attend_cuda.usable.cache_clear()
    cuda_build.can_run.cache_clear()
    with pytest.warns(RuntimeWarning, match="no libnvrtc"):
        assert backends.resolve(KernelOptions(), device, 128, 4, "rows")["attend"] == "triton"
    with pytest.raises(ValueError, match="no libnvrtc was found"):
        backends.resolve(KernelOptions(attend="cuda"), device, 128, 4, "rows")


# --------------------------------------------------------------------------------------------
# The build path under failure: cache folder, cached files, concurrent builders, NVRTC's
# architectures, a build that fails at the first launch
# --------------------------------------------------------------------------------------------


def fake_cubin(payload=b"", size=0):
    """A whole 64-bit ELF file as ``is_cubin`` reads its header: one 64-byte section header
    right after the file header, then ``payload`` (padded to ``size`` bytes in all)."""
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    header[0x28:0x30] = (64).to_bytes(8, "little")  # section headers at 64
    header[0x3A:0x3C] = (64).to_bytes(2, "little")  # of 64 bytes
    header[0x3C:0x3E] = (1).to_bytes(2, "little")   # one
    image = bytes(header) + bytes(64) + payload
    return image + bytes(max(0, size - len(image)))


@pytest.fixture
def fake_nvrtc(monkeypatch, tmp_path):
    """``compile_cubin`` replaced by a counter that returns ``fake_cubin(source's length)``,
    and the cache in a fresh folder: the build path without NVRTC."""
    compiles = []

    def compile_cubin(source, arch, options=(), name="moira.cu"):
        compiles.append(name)
        return fake_cubin(name.encode()), ""

    monkeypatch.setattr(cuda_build, "compile_cubin", compile_cubin)
    monkeypatch.setattr(cuda_build, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setenv("MOIRA_CACHE_DIR", str(tmp_path / "cache"))
    return compiles


def test_is_cubin_reads_the_elf_header():
    whole = fake_cubin(b"kernel")
    assert cuda_build.is_cubin(whole)
    assert not cuda_build.is_cubin(whole[:100])  # its section headers cut off
    assert not cuda_build.is_cubin(b"")
    assert not cuda_build.is_cubin(b"\x7fELF" + bytes(200))  # no class, no sections
    assert not cuda_build.is_cubin(b"<html>not a cubin</html>" + bytes(200))


def test_an_unwritable_cache_folder_costs_only_the_cache(fake_nvrtc, monkeypatch, tmp_path):
    """A compile that cannot be cached is used from memory, warned once; no temporary file is
    left behind where the folder existed but refused the rename."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MOIRA_CACHE_DIR", str(blocker / "cache"))  # under a file: no folder
    with pytest.warns(RuntimeWarning, match="cannot be cached in .*a-file.*MOIRA_CACHE_DIR"):
        assert cuda_build.build("select.cu", "90") == fake_cubin(b"select.cu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second build warns nothing
        assert cuda_build.build("select.cu", "90") == fake_cubin(b"select.cu")
    assert fake_nvrtc == ["select.cu", "select.cu"]
    # a folder that exists but whose rename fails (read-only mount, a full disk)
    monkeypatch.setenv("MOIRA_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()

    def refuse(source, target):
        raise PermissionError(13, "Permission denied", target)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.warns(RuntimeWarning, match="cannot be cached"):
        assert cuda_build.build("attend.cu", "90") == fake_cubin(b"attend.cu")
    assert os.listdir(tmp_path / "cache") == []


def test_a_corrupt_cached_cubin_is_rebuilt(fake_nvrtc, monkeypatch, tmp_path):
    """A cached file cut short or not a cubin at all is rebuilt and replaced, never returned;
    one whose header reads whole but that the driver refuses is rebuilt at the load, once."""
    whole = fake_cubin(b"select.cu")
    assert cuda_build.build("select.cu", "90") == whole
    (path,) = (tmp_path / "cache").iterdir()
    for damaged in (whole[:-40], b"", b"<html>proxy error</html>"):
        path.write_bytes(damaged)
        with pytest.warns(RuntimeWarning, match="not a whole ELF file.*rebuilt"):
            cuda_build._warned.clear()
            assert cuda_build.build("select.cu", "90") == whole
        assert path.read_bytes() == whole  # replaced on disk
    assert len(fake_nvrtc) == 4
    # whole by its header, refused by the driver (CUDA_ERROR_INVALID_IMAGE): rebuilt, loaded
    path.write_bytes(fake_cubin(b"bit rot"))
    loads = []

    def load(module, image):
        loads.append(image)
        return 200 if b"bit rot" in image else 0

    monkeypatch.setattr(cuda_build, "driver", lambda: SimpleNamespace(
        cuModuleLoadData=load, cuGetErrorString=lambda result, text: 0))
    with pytest.warns(RuntimeWarning, match="driver refused the cached cubin of select.cu"):
        cuda_build.module.__wrapped__(0, "select.cu", "90", ())
    assert loads == [fake_cubin(b"bit rot"), whole] and path.read_bytes() == whole
    # a fresh build the driver refuses is not rebuilt again: a BuildError
    monkeypatch.setattr(cuda_build, "driver", lambda: SimpleNamespace(
        cuModuleLoadData=lambda module, image: 200,
        cuGetErrorString=lambda result, text: 0))
    path.unlink()
    with pytest.raises(cuda_build.BuildError, match=r"cuModuleLoadData\(select.cu, sm_90\)"):
        cuda_build.module.__wrapped__(0, "select.cu", "90", ())


def test_concurrent_builders_write_whole_files(monkeypatch, tmp_path):
    """Builders racing on one cache entry (several vLLM workers starting together) each write
    a whole file by a rename within the folder: a reader meanwhile sees the entry absent or
    whole, never part of one, and no temporary file is left."""
    monkeypatch.setenv("MOIRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cuda_build, "nvrtc_version", lambda: (13, 0))
    image = fake_cubin(size=4 << 20)  # 4 MB: a write takes a while
    monkeypatch.setattr(cuda_build, "compile_cubin", lambda *args, **kwargs: (image, ""))
    start, seen, errors = threading.Barrier(5), [], []

    def builder():
        try:
            start.wait()
            for _ in range(10):
                assert cuda_build.build("attend.cu", "90", fresh=True) == image
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    def reader():
        start.wait()
        while any(thread.is_alive() for thread in builders):
            for name in os.listdir(tmp_path / "cache") if (tmp_path / "cache").exists() else ():
                if name.endswith(".cubin"):
                    with open(tmp_path / "cache" / name, "rb") as f:
                        seen.append(f.read() == image)

    builders = [threading.Thread(target=builder) for _ in range(4)]
    watcher = threading.Thread(target=reader)
    for thread in builders + [watcher]:
        thread.start()
    for thread in builders + [watcher]:
        thread.join()
    assert not errors
    assert seen and all(seen)
    (name,) = os.listdir(tmp_path / "cache")
    assert name.startswith("attend-sm90-") and name.endswith(".cubin")


@needs_nvrtc
def test_the_nvrtc_here_lists_its_architectures():
    archs = cuda_build.supported_archs()  # NVRTC 11.2+ lists them
    assert archs is not None and 90 in archs and cuda_build.supports("90")
    assert not cuda_build.supports("10")


def test_an_nvrtc_that_cannot_target_the_gpu_falls_back_or_raises(monkeypatch):
    """A GPU newer than the NVRTC found (sm_100 with an NVRTC that stops at sm_90): "auto"
    resolves every stage to Triton with one warning; an explicit "cuda" is a ValueError
    naming the architecture and the fix."""
    gpu = SimpleNamespace(major=10, minor=0, shared_memory_per_block_optin=227 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 0))
    monkeypatch.setattr(cuda_build, "nvrtc_library", lambda: "libnvrtc.so.12")
    monkeypatch.setattr(cuda_build, "nvrtc_version", lambda: (12, 1))
    monkeypatch.setattr(cuda_build, "supported_archs", lambda: (80, 86, 89, 90))
    device = torch.device("cuda", 0)
    attend_cuda.usable.cache_clear()
    cuda_build.can_run.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resolved = backends.resolve(KernelOptions(estimate="auto", select="auto"), device,
                                        128, 4, "rows")
        assert resolved == {"estimate": "triton", "select": "triton", "attend": "triton",
                            "fused": "off"}
        (warning,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert "NVRTC 12.1 cannot build for this GPU's sm_100" in str(warning.message)
        for stage in ("estimate", "select", "attend"):
            with pytest.raises(ValueError, match=rf"KernelOptions\({stage}='cuda'\) cannot "
                                                 rf"run here: NVRTC 12.1 cannot build for "
                                                 rf"this GPU's sm_100 .*sm_80 to sm_90.*"
                                                 rf"nvidia-cuda-nvrtc"):
                backends.resolve(KernelOptions(**{stage: "cuda"}), device, 128, 4, "rows")
    finally:
        attend_cuda.usable.cache_clear()
        cuda_build.can_run.cache_clear()


@pytest.fixture
def failing_builds(monkeypatch, fake_nvrtc):
    """The CUDA launchers run on the CPU as far as their first build, whose NVRTC compile
    fails: the torch.cuda and driver calls before it answer as an sm_90 GPU would, and the
    kernels' input checks pass (they would refuse CPU tensors). Yields the compile count."""
    attempts = []

    def compile_fails(source, arch, options=(), name="moira.cu"):
        attempts.append(name)
        raise cuda_build.BuildError(f"NVRTC failed on {name} for sm_{arch}:\n(made up)")

    monkeypatch.setattr(cuda_build, "compile_cubin", compile_fails)
    monkeypatch.setattr(cuda_build, "device_index", lambda device: 0)
    monkeypatch.setattr(cuda_build, "make_current", lambda index: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(
        major=9, minor=0, shared_memory_per_block_optin=227 * 1024, multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    for module in (attend_cuda, estimate_cuda, select_cuda):
        monkeypatch.setattr(module, "check_inputs", lambda *args: None)
    for kernel in (attend_cuda.kernel, estimate_cuda.kernel, select_cuda.kernel):
        kernel.cache_clear()
    yield attempts
    for kernel in (attend_cuda.kernel, estimate_cuda.kernel, select_cuda.kernel):
        kernel.cache_clear()


def cuda_resolved_workspace(step, kernels):
    """A workspace for ``step`` on the CPU whose stages resolved to CUDA, as on a GPU."""
    query, keys, table = step[0], step[1], step[4]
    workspace = moira.DecodeWorkspace.for_step(query, keys, table, config=SMALL_SPLIT)
    workspace.config = SMALL_SPLIT.replace(kernels=kernels)  # an explicit "cuda" too
    workspace.backends = {"estimate": "cuda", "select": "cuda", "attend": "cuda",
                          "fused": "off"}
    return workspace


def decode_step():
    keys, values = make_cache(24, 2, 64)
    table, seq_lens = make_table([64 * 5 + 3, 64 * 2], 24)
    query = make_query(2, 8, 64)
    return query, keys, values, moira.summarize(keys, table, seq_lens), table, seq_lens


def test_a_build_that_fails_at_the_first_launch_falls_back_under_auto(failing_builds):
    """Under "auto" a CUDA kernel whose build fails at its first launch hands its stage to
    Triton, warned once per stage; the workspace remembers (later steps build nothing), and the
    step's output is the Triton kernels'. Under "cuda" the BuildError is raised."""
    step = decode_step()
    triton = moira.sparse_decode(*step, config=SMALL_SPLIT.replace(kernels=KernelOptions(
        estimate="triton", select="triton", attend="triton")))
    everywhere = KernelOptions(estimate="auto", select="auto", attend="auto",
                               tuning={"estimate.cuda_from_pages": 0,
                                       "select.cuda_from_pages": 0})
    workspace = cuda_resolved_workspace(step, everywhere)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = moira.sparse_decode(*step, workspace=workspace)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 3, messages
    for stage, source in (("estimate", "estimate.cu"), ("select", "select.cu"),
                          ("attend", "attend.cu")):
        assert any(f"{stage}='auto' runs the Triton kernel: the CUDA kernel could not be "
                   f"built" in m and source in m for m in messages), (stage, messages)
    assert failing_builds == ["estimate.cu", "select.cu", "attend.cu"]
    assert workspace.backends == {"estimate": "triton", "select": "triton",
                                  "attend": "triton", "fused": "off"}
    assert torch.equal(out, triton)
    # remembered: the workspace's next step, and a new workspace's, build nothing again and
    # warn nothing again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(moira.sparse_decode(*step, workspace=workspace), triton)
        again = cuda_resolved_workspace(step, everywhere)
        assert torch.equal(moira.sparse_decode(*step, workspace=again), triton)
    assert len(failing_builds) == 3
    # an explicit "cuda" raises the build's error (a RuntimeError)
    for stage in ("estimate", "select", "attend"):
        explicit = KernelOptions(**{stage: "cuda"}, tuning={"estimate.cuda_from_pages": 0,
                                                            "select.cuda_from_pages": 0})
        with pytest.raises(RuntimeError, match=rf"NVRTC failed on {stage}\.cu for sm_90"):
            moira.sparse_decode(*step, workspace=cuda_resolved_workspace(step, explicit))


def test_a_failed_build_is_not_retried_inside_a_capture(failing_builds, monkeypatch):
    """A kernel whose build failed raises its BuildError again at once, before the capture
    check (so "auto" runs Triton inside a capture too); one never built raises the capture
    error, which no fallback catches."""
    with pytest.raises(cuda_build.BuildError):
        cuda_build.function(0, "select.cu", "moira_select_p8_w4_g4", "select")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(cuda_build.BuildError):
        cuda_build.function(0, "select.cu", "moira_select_p8_w4_g4", "select")
    with pytest.raises(RuntimeError, match="must not be inside a CUDA graph capture") as error:
        cuda_build.function(0, "attend.cu", "moira_attend_d64_s2", "attend")
    assert not isinstance(error.value, cuda_build.BuildError)
    assert failing_builds == ["select.cu"]
