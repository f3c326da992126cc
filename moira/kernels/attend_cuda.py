"""Attend in CUDA C++ (``attend.IMPLEMENTATION = "cuda"``): ``attend_cuda.cu``'s kernel, built
by NVRTC on first use and launched through the CUDA driver API (ctypes), so it needs no
compiled extension, no CUDA toolkit and no package beyond torch (whose CUDA builds install
``libnvrtc``, the ``nvidia-cuda-nvrtc`` wheel).

The kernel is Attend's Triton kernel with a deeper K/V pipeline (the .cu file says why); the
same plan, partials and outputs, so Merge and the rest of the step are unchanged. It runs by
default where it can (``attend.IMPLEMENTATION = "auto"``, ``runs``); it covers the default
Attend only (``PAGE_IDS_AHEAD``, ``FA3_TILE_ORDER``, ``EVEN_CHUNKS``, float32 weight sums and
the balanced schedule are the Triton kernel's).

The binary (a cubin for the GPU's architecture) is cached under ``$MOIRA_CACHE_DIR`` (default
``~/.cache/moira``), keyed by the source, the options and NVRTC's version. Build it before a
CUDA graph is captured (a warm-up step does): a module cannot be loaded while a stream
captures.
"""

import ctypes
import functools
import glob
import hashlib
import os
import sys
import tempfile
import warnings

import torch

from ..config import PAGE_SIZE

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attend_cuda.cu")
# the .cu file's THREADS and STAGED_IDS (its PAGE is config.PAGE_SIZE)
THREADS = 128
STAGED_IDS = 256
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # query heads per KV head: the 16 rows of mma.m16n8k16


class Params(ctypes.Structure):
    """``Params`` of attend_cuda.cu, field by field (the kernel's one argument)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "query", "key_cache", "value_cache", "block_table", "seq_lens", "page_lists",
        "page_counts", "out", "partial_out", "partial_lse")]
        + [(name, ctypes.c_int64) for name in (
            "stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp",
            "stride_vt", "stride_vh", "stride_bt", "stride_pb", "stride_ph", "stride_cb",
            "stride_ch", "stride_ob", "stride_oh", "stride_od")]
        + [(name, ctypes.c_int) for name in (
            "num_kv_heads", "max_pages", "group", "chunk_floor", "chunks_per_row", "step_rows",
            "step_programs", "short_pages")]
        + [("qk_scale_log2", ctypes.c_float)])


def shared_bytes(head_dim, stages):
    """Dynamic shared memory of a program: the stages' K and V pages and the staged page ids
    (int64) and token counts (int32); the end's merge reuses it."""
    return stages * 2 * PAGE_SIZE * head_dim * 2 + STAGED_IDS * (8 + 4)


def nvrtc_library():
    """The path or name of a loadable libnvrtc, or None: the ``nvidia-cuda-nvrtc`` wheel's (the
    one of torch's CUDA version first), else a CUDA toolkit's ($CUDA_HOME, /usr/local/cuda, the
    loader's path)."""
    folders = [os.path.join(folder, "nvidia", "*", "lib") for folder in sys.path
               if os.path.isabs(folder)]  # not "": the working directory
    folders += [os.path.join(root, "lib64") for root in (os.environ.get("CUDA_HOME"),
                                                        "/usr/local/cuda") if root]
    found = [path for folder in folders
             for path in sorted(glob.glob(os.path.join(folder, "libnvrtc.so.*")))]
    major = (torch.version.cuda or "").split(".")[0]
    found.sort(key=lambda path: not path.endswith(f".so.{major}"))  # stable: torch's first
    for candidate in found + [f"libnvrtc.so.{major}"] * bool(major) + ["libnvrtc.so"]:
        try:
            ctypes.CDLL(candidate)
        except OSError:
            continue
        return candidate
    return None


@functools.lru_cache(maxsize=None)
def _nvrtc():
    """libnvrtc's entry points used here, typed (nvrtcResult is an int)."""
    library = nvrtc_library()
    if library is None:
        raise RuntimeError("attend.IMPLEMENTATION = 'cuda' builds its kernel with NVRTC, and no "
                           "libnvrtc was found: pip install nvidia-cuda-nvrtc (torch's CUDA "
                           "builds bring it) or use 'triton'")
    # NVRTC dlopens its builtins library by name, and 13.0's wheel does not find it beside
    # itself unless a CUDA build of torch has loaded it already: load it first
    folder = os.path.dirname(library)  # "" for a name the loader resolves
    for builtins in glob.glob(os.path.join(folder, "libnvrtc-builtins.so.*")) if folder else ():
        try:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass  # then NVRTC's own lookup, whose failure compile_cubin reports
    nvrtc = ctypes.CDLL(library)
    program, size = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
    for name, argtypes in (
            ("nvrtcVersion", (ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))),
            ("nvrtcCreateProgram", (program, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_void_p)),
            ("nvrtcCompileProgram", (ctypes.c_void_p, ctypes.c_int,
                                     ctypes.POINTER(ctypes.c_char_p))),
            ("nvrtcGetProgramLogSize", (ctypes.c_void_p, size)),
            ("nvrtcGetProgramLog", (ctypes.c_void_p, ctypes.c_char_p)),
            ("nvrtcGetCUBINSize", (ctypes.c_void_p, size)),
            ("nvrtcGetCUBIN", (ctypes.c_void_p, ctypes.c_char_p)),
            ("nvrtcDestroyProgram", (program,))):
        function = getattr(nvrtc, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return nvrtc


def nvrtc_version():
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_cubin(source, arch, options=()):
    """``(cubin, log)``: CUDA C++ ``source`` (bytes) compiled by NVRTC for ``sm_<arch>`` (e.g.
    "90") with more NVRTC ``options`` (e.g. ``--ptxas-options=-v``, whose report is the
    log); a RuntimeError with the log if it does not compile."""
    nvrtc, program = _nvrtc(), ctypes.c_void_p()
    failed = nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"attend_cuda.cu", 0,
                                      None, None)
    if failed:
        raise RuntimeError(f"nvrtcCreateProgram failed: nvrtcResult {failed}")
    try:
        flags = [f"--gpu-architecture=sm_{arch}".encode()] + [o.encode() for o in options]
        failed = nvrtc.nvrtcCompileProgram(program, len(flags),
                                           (ctypes.c_char_p * len(flags))(*flags))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        log = log.value.decode(errors="replace")
        if failed:
            raise RuntimeError(f"NVRTC failed on {SOURCE} for sm_{arch}:\n{log}")
        cubin = b""
        if not nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)):
            buffer = ctypes.create_string_buffer(size.value)
            if not nvrtc.nvrtcGetCUBIN(program, buffer):
                cubin = buffer.raw
        if not cubin.startswith(b"\x7fELF"):  # never cached: every later load would fail
            raise RuntimeError(f"NVRTC returned no cubin for sm_{arch} (an architecture "
                               f"this NVRTC cannot assemble?):\n{log}")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def build(arch):
    """The cubin of ``attend_cuda.cu`` for ``sm_<arch>`` (e.g. "90"): cached, else built."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + f"sm_{arch} nvrtc {nvrtc_version()}".encode()).hexdigest()
    cache = os.environ.get("MOIRA_CACHE_DIR", os.path.expanduser("~/.cache/moira"))
    path = os.path.join(cache, f"attend-sm{arch}-{key[:16]}.cubin")
    if not os.path.exists(path):
        cubin, _ = compile_cubin(source, arch)
        os.makedirs(cache, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".cubin", dir=cache)
        with os.fdopen(handle, "wb") as f:
            f.write(cubin)
        os.chmod(partial, 0o644)  # mkstemp's 0600 would shut other users out of a shared cache
        os.replace(partial, path)  # atomic: concurrent builders each write a whole file
    with open(path, "rb") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda's entry points used here, typed (CUresult is an int; handles are pointers)."""
    driver = ctypes.CDLL("libcuda.so.1")
    handle, out, text, uint = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                               ctypes.c_char_p, ctypes.c_uint)
    for name, argtypes in (
            ("cuModuleLoadData", (out, text)),
            ("cuDeviceGet", (ctypes.POINTER(ctypes.c_int), ctypes.c_int)),
            ("cuDevicePrimaryCtxRetain", (out, ctypes.c_int)),
            ("cuCtxGetCurrent", (out,)),
            ("cuCtxSetCurrent", (handle,)),
            ("cuDeviceGetAttribute", (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)),
            ("cuModuleGetFunction", (out, handle, text)),
            ("cuFuncSetAttribute", (handle, ctypes.c_int, ctypes.c_int)),
            ("cuLaunchKernel", (handle, uint, uint, uint, uint, uint, uint, uint, handle,
                                ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)),
            ("cuGetErrorString", (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)))):
        function = getattr(driver, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return driver


def _check(result, what):
    if result:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUDA error {result} "
                           f"({(text.value or b'?').decode()})")


@functools.lru_cache(maxsize=None)
def _device(device_index):
    """The driver's handle (CUdevice) of a device ordinal."""
    device = ctypes.c_int()
    _check(_driver().cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    return device.value


@functools.lru_cache(maxsize=None)
def _primary_context(device_index):
    """The device's primary context (the one torch's runtime uses), retained once."""
    context = ctypes.c_void_p()
    _check(_driver().cuDevicePrimaryCtxRetain(ctypes.byref(context), _device(device_index)),
           "cuDevicePrimaryCtxRetain")
    return context.value


def _context(device_index):
    """Make the device's primary context current on this thread if it is not: the driver API
    loads and launches in the calling thread's current context, which a thread that has not
    used the runtime on this device lacks."""
    context, current = _primary_context(device_index), ctypes.c_void_p()
    _check(_driver().cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value != context:
        _check(_driver().cuCtxSetCurrent(ctypes.c_void_p(context)), "cuCtxSetCurrent")


@functools.lru_cache(maxsize=None)
def kernel(device_index, head_dim, stages):
    """The loaded function ``moira_attend_d<D>_s<S>`` on a device (its module loaded once)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        raise ValueError(f"attend.IMPLEMENTATION = 'cuda' needs sm_80 or newer (mma.sync on "
                         f"bf16, cp.async); this GPU is sm_{major}{minor}: use 'triton'")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("attend.IMPLEMENTATION = 'cuda' loads its kernel at the first "
                           "launch, which must not be inside a CUDA graph capture: run one "
                           "step eagerly before capturing")
    with torch.cuda.device(device_index):
        torch.cuda.init()
        _context(device_index)
        limit = ctypes.c_int()
        # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        _check(_driver().cuDeviceGetAttribute(ctypes.byref(limit), 97, _device(device_index)),
               "cuDeviceGetAttribute")
        if shared_bytes(head_dim, stages) > limit.value:
            raise ValueError(f"attend.CUDA_STAGES = {stages} needs "
                             f"{shared_bytes(head_dim, stages)} bytes of shared memory per "
                             f"program at head_dim {head_dim}; this GPU allows {limit.value}: "
                             f"lower CUDA_STAGES")
        module = _module(device_index, f"{major}{minor}")
        function = ctypes.c_void_p()
        name = f"moira_attend_d{head_dim}_s{stages}".encode()
        _check(_driver().cuModuleGetFunction(ctypes.byref(function), module, name),
               f"cuModuleGetFunction({name.decode()})")
        # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: above the default 48 KB
        _check(_driver().cuFuncSetAttribute(function, 8, shared_bytes(head_dim, stages)),
               "cuFuncSetAttribute")
    return function


@functools.lru_cache(maxsize=None)
def _module(device_index, arch):
    image = build(arch)
    module = ctypes.c_void_p()
    _check(_driver().cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
    return module


def check_inputs(query, key_cache, value_cache, head_dim, group, stages):
    """A ValueError naming what the CUDA Attend cannot read, and the fix."""
    if query.device.type != "cuda":
        raise ValueError(f"attend.IMPLEMENTATION = 'cuda' runs on CUDA tensors, got "
                         f"{query.device}: use 'triton' (the interpreter) on the CPU")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"attend.IMPLEMENTATION = 'cuda' is built for head_dim in "
                         f"{HEAD_DIMS}, got {head_dim}: use 'triton'")
    if group > MAX_GROUP:
        raise ValueError(f"attend.IMPLEMENTATION = 'cuda' takes at most {MAX_GROUP} query "
                         f"heads per KV head, got {group}: use 'triton'")
    if stages not in (2, 3, 4):
        raise ValueError(f"attend.CUDA_STAGES must be 2, 3 or 4, got {stages}")
    for name, tensor in (("query", query), ("key_cache", key_cache),
                         ("value_cache", value_cache)):
        if tensor.dtype != torch.bfloat16:
            raise ValueError(f"attend.IMPLEMENTATION = 'cuda' reads bfloat16, got {name} "
                             f"{tensor.dtype}: use 'triton'")
        if tensor.stride(-1) != 1:
            raise ValueError(f"attend.IMPLEMENTATION = 'cuda' needs {name}'s head dim "
                             f"contiguous (stride {tensor.stride()}): use 'triton'")
    # 16-byte copies of the caches, 4-byte loads of the query
    for name, tensor, unit in (("key_cache", key_cache, 8), ("value_cache", value_cache, 8),
                               ("query", query, 2)):
        if tensor.data_ptr() % (2 * unit) or any(s % unit for s in tensor.stride()[:-1]):
            raise ValueError(f"attend.IMPLEMENTATION = 'cuda' needs {name} aligned to "
                             f"{2 * unit} bytes in every stride (strides {tensor.stride()}): "
                             f"use 'triton'")


def runs(query, key_cache, value_cache, stages):
    """Whether this kernel can run a call (``attend.IMPLEMENTATION = "auto"``): False for what
    ``check_inputs`` or ``kernel`` would refuse, and where no libnvrtc is found (warned once)."""
    num_kv_heads, head_dim = key_cache.shape[2], query.shape[2]
    try:
        check_inputs(query, key_cache, value_cache, head_dim, query.shape[1] // num_kv_heads,
                     stages)
    except ValueError:
        return False
    return _device_runs(query.device.index if query.device.index is not None
                        else torch.cuda.current_device(), head_dim, stages)


@functools.lru_cache(maxsize=None)
def _device_runs(device_index, head_dim, stages):
    properties = torch.cuda.get_device_properties(device_index)
    if properties.major < 8 or shared_bytes(head_dim, stages) > \
            properties.shared_memory_per_block_optin:
        return False
    if nvrtc_library() is None:
        warnings.warn("Moira's CUDA Attend needs libnvrtc (pip install nvidia-cuda-nvrtc; "
                      "torch's CUDA builds bring it) and none was found: Attend runs its "
                      "Triton kernel, 1-5% slower", RuntimeWarning, stacklevel=2)
        return False
    return True


def attend(query, key_cache, value_cache, block_table, seq_lens, page_lists, page_counts, *,
           qk_scale_log2, chunk_floor, chunks_per_row, out, partial_out, partial_lse,
           step_rows, step_programs, short_pages, stages, build_only=False):
    """Launch ``attend_cuda.cu``'s kernel on the current stream: the arguments of
    ``attend.attend`` (the scale already in log2 units, the short-row bound computed)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    check_inputs(query, key_cache, value_cache, head_dim, group, stages)
    device_index = query.device.index if query.device.index is not None \
        else torch.cuda.current_device()
    function = kernel(device_index, head_dim, stages)
    if build_only:
        return out
    _context(device_index)
    params = Params(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
        seq_lens.data_ptr(), page_lists.data_ptr(), page_counts.data_ptr(), out.data_ptr(),
        partial_out.data_ptr(), partial_lse.data_ptr(),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), page_lists.stride(0), page_lists.stride(1),
        page_counts.stride(0), page_counts.stride(1), *out.stride(),
        num_kv_heads, block_table.shape[1], group, chunk_floor, chunks_per_row, step_rows,
        step_programs, short_pages, qk_scale_log2)
    arguments = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    stream = ctypes.c_void_p(torch.cuda.current_stream(query.device).cuda_stream)
    _check(_driver().cuLaunchKernel(
        function, batch * num_kv_heads, chunks_per_row, 1, THREADS, 1, 1,
        shared_bytes(head_dim, stages), stream, arguments, None), "cuLaunchKernel")
    return out
