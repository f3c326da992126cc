"""The NVRTC build and its cache (``cuda_build``): CPU only, given a libnvrtc."""

import os

import pytest
from helpers import needs_nvrtc

from moira.kernels import cuda_build


@needs_nvrtc
def test_build_is_cached_by_source(tmp_path, monkeypatch):
    """One NVRTC build per source, architecture and NVRTC version: the second call reads the
    cached cubin, and a changed source is built anew."""
    monkeypatch.setenv("MOIRA_CACHE_DIR", str(tmp_path / "cache"))
    image = cuda_build.build("attend_cuda.cu", "90")
    assert image[:4] == b"\x7fELF" and b"moira_attend_d128_s2" in image
    assert os.listdir(tmp_path / "cache")[0].startswith("attend_cuda-sm90-")
    compile_cubin = cuda_build.compile_cubin
    monkeypatch.setattr(cuda_build, "compile_cubin", None)  # a second build would fail
    assert cuda_build.build("attend_cuda.cu", "90") == image
    changed = tmp_path / "attend_cuda.cu"
    with open(cuda_build.source_path("attend_cuda.cu")) as f:
        changed.write_text(f.read() + "\n// changed\n")
    real_path = cuda_build.source_path
    monkeypatch.setattr(cuda_build, "source_path", lambda file_name: str(changed)
                        if file_name == "attend_cuda.cu" else real_path(file_name))
    monkeypatch.setattr(cuda_build, "compile_cubin", compile_cubin)
    cuda_build.build("attend_cuda.cu", "90")
    assert len(os.listdir(tmp_path / "cache")) == 2
    # a changed header (what the sources include) is a changed build too
    header = tmp_path / "moira_cuda.cuh"
    with open(real_path("moira_cuda.cuh")) as f:
        header.write_text(f.read() + "\n// changed\n")
    monkeypatch.setattr(cuda_build, "source_path", lambda file_name: str(
        {"attend_cuda.cu": changed, "*.cuh": header}.get(file_name) or real_path(file_name)))
    cuda_build.build("attend_cuda.cu", "90")
    assert len(os.listdir(tmp_path / "cache")) == 3


@needs_nvrtc
def test_a_compile_error_names_the_file_and_the_line():
    with pytest.raises(RuntimeError, match=r"broken\.cu.*sm_90(.|\n)*broken\.cu\(1\)"):
        cuda_build.compile_cubin(b"this is not C++;\n", "90", name="broken.cu")


def test_launch_passes_the_drivers_arguments_in_order(monkeypatch):
    """cuLaunchKernel(f, grid x, y, z, block x, y, z, shared bytes, stream, params, extra),
    with the structure's address as the one kernel argument (checked without a GPU: a wrong
    count or order is found only by launching otherwise)."""
    import ctypes
    from types import SimpleNamespace

    import torch

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
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    with pytest.raises(ValueError, match="select.IMPLEMENTATION = 'cuda' needs sm_80.*sm_75"):
        cuda_build.function(0, "select_cuda.cu", "moira_select_p8_w4_g4", "select.IMPLEMENTATION")


def test_resolve_checks_the_inputs_once_and_falls_back_only_under_auto():
    """"cuda" raises the check's error; "auto" takes Triton's kernel for inputs the check
    refuses or a device that cannot build (asked only once the inputs pass); "triton" asks
    nothing; any other value is refused."""
    def refuse():
        raise ValueError("float16")

    def unreachable():
        raise AssertionError("asked")

    assert cuda_build.resolve("x.IMPLEMENTATION", "triton", unreachable, unreachable) == "triton"
    with pytest.raises(ValueError, match="float16"):
        cuda_build.resolve("x.IMPLEMENTATION", "cuda", refuse, unreachable)
    assert cuda_build.resolve("x.IMPLEMENTATION", "cuda", lambda: None, unreachable) == "cuda"
    assert cuda_build.resolve("x.IMPLEMENTATION", "auto", refuse, unreachable) == "triton"
    assert cuda_build.resolve("x.IMPLEMENTATION", "auto", lambda: None, lambda: False) == "triton"
    assert cuda_build.resolve("x.IMPLEMENTATION", "auto", lambda: None, lambda: True) == "cuda"
    with pytest.raises(ValueError, match="x.IMPLEMENTATION must be 'auto', 'triton' or 'cuda'"):
        cuda_build.resolve("x.IMPLEMENTATION", "fast", unreachable, unreachable)
