"""The NVRTC build and its cache (``moira.kernels.cuda.build``), the driver launch, and how a
stage's ``KernelOptions`` choice meets what a call's inputs allow (``moira.kernels.backends``):
no GPU needed (the builds need a libnvrtc)."""

import ctypes
import os
from types import SimpleNamespace

import pytest
import torch
from helpers import needs_nvrtc

from moira import KernelOptions, MoiraConfig
from moira.kernels import backends
from moira.kernels.cuda import attend as attend_cuda
from moira.kernels.cuda import build as cuda_build


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
    monkeypatch.setattr(cuda_build, "can_run", lambda index, what: True)
    attend_cuda.usable.cache_clear()
    yield gpu
    attend_cuda.usable.cache_clear()


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
    monkeypatch.setattr(cuda_build, "can_run", lambda index, what: False)  # no libnvrtc
    attend_cuda.usable.cache_clear()
    assert backends.resolve(KernelOptions(), device, 128, 4, "rows")["attend"] == "triton"
    with pytest.raises(ValueError, match="no libnvrtc was found"):
        backends.resolve(KernelOptions(attend="cuda"), device, 128, 4, "rows")
