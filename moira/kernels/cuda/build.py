"""CUDA C++ kernels built at run time: NVRTC compiles a ``.cu`` file of this folder for the
GPU's architecture (cached on disk), and the CUDA driver API (ctypes) loads and launches it.
So a CUDA kernel needs no compiled extension, no CUDA toolkit and no package beyond torch, whose
CUDA builds install ``libnvrtc`` (the ``nvidia-cuda-nvrtc`` wheel). Used by this folder's
``attend``, ``estimate``, ``select`` and ``estimate_select``.

The binaries (cubins) are cached under ``$MOIRA_CACHE_DIR`` (default ``~/.cache/moira``), keyed
by the source, the headers it may include (``*.cuh``), the options, the architecture and
NVRTC's version. Build a kernel before a CUDA graph is
captured (a warm-up step does): a module cannot be loaded while a stream captures.

What cannot be built or loaded raises ``BuildError``, which ``"auto"`` turns into the Triton
kernel (``moira.kernels.backends``): no libnvrtc, an architecture this NVRTC cannot target, a
compile error, a cubin the driver refuses. A cache folder that cannot be written costs only the
cache (warned once); a cached cubin that is truncated or refused by the driver is rebuilt.
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


class BuildError(RuntimeError):
    """A CUDA kernel that cannot be built or loaded here. Under ``"auto"`` its stage runs the
    Triton kernel instead (``backends.build_failed``); under ``"cuda"`` it is raised."""


_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


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
        raise BuildError("Moira's CUDA kernels are built by NVRTC, and no libnvrtc was "
                           "found: pip install nvidia-cuda-nvrtc (torch's CUDA builds bring "
                           "it), or choose the Triton kernels: KernelOptions(estimate='triton', "
                           "attend='triton')")
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
    for name in ("nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs"):  # NVRTC 11.2+
        if hasattr(nvrtc, name):
            function = getattr(nvrtc, name)
            function.argtypes, function.restype = (ctypes.POINTER(ctypes.c_int),), ctypes.c_int
    return nvrtc


def nvrtc_version():
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


@functools.lru_cache(maxsize=None)
def supported_archs():
    """The architectures this NVRTC can build for, as ints (e.g. ``(75, 80, ..., 120)``), or
    None where it cannot say (an NVRTC older than 11.2)."""
    nvrtc = _nvrtc()
    if not hasattr(nvrtc, "nvrtcGetSupportedArchs"):
        return None
    count = ctypes.c_int()
    if nvrtc.nvrtcGetNumSupportedArchs(ctypes.byref(count)) or count.value <= 0:
        return None
    archs = (ctypes.c_int * count.value)()
    if nvrtc.nvrtcGetSupportedArchs(archs):
        return None
    return tuple(archs)


def supports(arch):
    """Whether this NVRTC can build for ``sm_<arch>`` (e.g. "90"); True where it cannot say."""
    archs = supported_archs()
    return archs is None or int(arch) in archs


def compile_cubin(source, arch, options=(), name="moira.cu"):
    """``(cubin, log)``: CUDA C++ ``source`` (bytes) compiled by NVRTC for ``sm_<arch>`` (e.g.
    "90") with more NVRTC ``options`` (e.g. ``--ptxas-options=-v``, whose report is the
    log); a BuildError (a RuntimeError) with the log if it does not compile. ``name``: the
    file named in NVRTC's messages. This folder is on the include path (``common.cuh``)."""
    nvrtc, program = _nvrtc(), ctypes.c_void_p()
    failed = nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, name.encode(), 0,
                                      None, None)
    if failed:
        raise BuildError(f"nvrtcCreateProgram failed: nvrtcResult {failed}")
    try:
        flags = [f"--gpu-architecture=sm_{arch}", f"--include-path={source_path('')}",
                 *options]
        flags = [flag.encode() for flag in flags]
        failed = nvrtc.nvrtcCompileProgram(program, len(flags),
                                           (ctypes.c_char_p * len(flags))(*flags))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        log = log.value.decode(errors="replace")
        if failed:
            raise BuildError(f"NVRTC failed on {name} for sm_{arch}:\n{log}")
        cubin = b""
        if not nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)):
            buffer = ctypes.create_string_buffer(size.value)
            if not nvrtc.nvrtcGetCUBIN(program, buffer):
                cubin = buffer.raw
        if not is_cubin(cubin):  # never cached: every later load would fail
            raise BuildError(f"NVRTC returned no cubin for sm_{arch} (an architecture "
                               f"this NVRTC cannot assemble?):\n{log}")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def source_path(file_name):
    """The path of a ``.cu`` file of this folder."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), file_name)


def is_cubin(image):
    """Whether ``image`` (bytes) is a whole 64-bit ELF file as far as its header tells: the magic,
    the class, and section and program header tables that end inside it (a truncated cubin
    fails this; one corrupt inside is found by the driver's load, ``module``)."""
    if len(image) < 64 or not image.startswith(b"\x7fELF") or image[4] != 2:
        return False
    order = "little" if image[5] == 1 else "big"

    def field(offset, size):
        return int.from_bytes(image[offset:offset + size], order)

    program_end = field(0x20, 8) + field(0x36, 2) * field(0x38, 2)
    section_end = field(0x28, 8) + field(0x3A, 2) * field(0x3C, 2)
    return field(0x3C, 2) > 0 and max(program_end, section_end) <= len(image)


def _write(cache, path, cubin):
    """Store ``cubin`` at ``path`` atomically: a temporary file of the same folder renamed into
    place, so concurrent builders (several vLLM workers) each write a whole file and a reader
    never sees a partial one. A folder that cannot be written costs only the cache (warned
    once): the build is used from memory."""
    partial = None
    try:
        os.makedirs(cache, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=".", suffix=".cubin.partial", dir=cache)
        with os.fdopen(handle, "wb") as f:
            f.write(cubin)
        os.chmod(partial, 0o644)  # mkstemp's 0600 would shut other users out of a shared cache
        os.replace(partial, path)
    except OSError as error:
        if partial is not None:
            try:
                os.unlink(partial)
            except OSError:
                pass
        _warn_once(f"Moira's CUDA kernels cannot be cached in {cache} ({error}): each process "
                   f"builds them anew (about a second each); set $MOIRA_CACHE_DIR to a "
                   f"writable folder")


def _build(file_name, arch, options=(), fresh=False):
    """``(cubin, cached)``: ``build``'s cubin, and whether it came from the cache. ``fresh``:
    build even where a cached cubin exists (and replace it)."""
    with open(source_path(file_name), "rb") as f:
        source = f.read()
    headers = b""  # what the source may include: a changed header is a changed build
    for header in sorted(glob.glob(source_path("*.cuh"))):
        with open(header, "rb") as f:
            headers += f.read()
    key = hashlib.sha256(source + headers + f"sm_{arch} nvrtc {nvrtc_version()} "
                         f"{' '.join(options)}".encode()).hexdigest()
    cache = os.environ.get("MOIRA_CACHE_DIR", os.path.expanduser("~/.cache/moira"))
    stem = os.path.splitext(file_name)[0]
    path = os.path.join(cache, f"{stem}-sm{arch}-{key[:16]}.cubin")
    if not fresh:
        try:
            with open(path, "rb") as f:
                cached = f.read()
        except OSError:  # not cached (or unreadable): built below
            cached = None
        if cached is not None and is_cubin(cached):
            return cached, True
        if cached is not None:
            _warn_once(f"the cached cubin {path} is not a whole ELF file ({len(cached)} "
                       f"bytes): rebuilt")
    cubin, _ = compile_cubin(source, arch, options, name=file_name)
    _write(cache, path, cubin)
    return cubin, False


def build(file_name, arch, options=(), fresh=False):
    """The cubin of this folder's ``file_name`` (e.g. "attend.cu") for ``sm_<arch>``
    (e.g. "90") with NVRTC ``options`` (e.g. ``("-DSELECT_P=8",)``): cached, else built (and
    cached where the folder can be written); a cached file that is not a whole cubin is
    rebuilt, as is any with ``fresh``. A BuildError if NVRTC cannot build it."""
    return _build(file_name, arch, options, fresh)[0]


@functools.lru_cache(maxsize=None)
def driver():
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


def check(result, what, error=RuntimeError):
    if result:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(result, ctypes.byref(text))
        raise error(f"{what} failed: CUDA error {result} "
                           f"({(text.value or b'?').decode()})")


@functools.lru_cache(maxsize=None)
def device(device_index):
    """The driver's handle (CUdevice) of a device ordinal."""
    device = ctypes.c_int()
    check(driver().cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    return device.value


@functools.lru_cache(maxsize=None)
def primary_context(device_index):
    """The device's primary context (the one torch's runtime uses), retained once."""
    context = ctypes.c_void_p()
    check(driver().cuDevicePrimaryCtxRetain(ctypes.byref(context), device(device_index)),
           "cuDevicePrimaryCtxRetain")
    return context.value


def make_current(device_index):
    """Make the device's primary context current on this thread if it is not: the driver API
    loads and launches in the calling thread's current context, which a thread that has not
    used the runtime on this device lacks."""
    context, current = primary_context(device_index), ctypes.c_void_p()
    check(driver().cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value != context:
        check(driver().cuCtxSetCurrent(ctypes.c_void_p(context)), "cuCtxSetCurrent")


@functools.lru_cache(maxsize=None)
def module(device_index, file_name, arch, options=()):
    """``file_name``'s module (built with ``options``) loaded on a device, once. A cached cubin
    the driver refuses is rebuilt and loaded once more; a BuildError if that fails too."""
    image, cached = _build(file_name, arch, options)
    module = ctypes.c_void_p()
    failed = driver().cuModuleLoadData(ctypes.byref(module), image)
    if failed and cached:
        _warn_once(f"the driver refused the cached cubin of {file_name} for sm_{arch} (CUDA "
                   f"error {failed}): rebuilt")
        image, _ = _build(file_name, arch, options, fresh=True)
        failed = driver().cuModuleLoadData(ctypes.byref(module), image)
    check(failed, f"cuModuleLoadData({file_name}, sm_{arch})", BuildError)
    return module


_failed = {}  # (device, file, arch, options) -> the BuildError its build raised


def function(device_index, file_name, name, setting, dynamic_shared=0, options=()):
    """The kernel ``name`` of ``file_name``'s module (built with NVRTC ``options``, a tuple)
    on a device, built and loaded on first use (which must not be inside a CUDA graph
    capture), allowed ``dynamic_shared`` bytes of dynamic shared memory; a ValueError naming
    ``setting`` (e.g. "attend") on a GPU older than sm_80; a BuildError where it cannot be
    built or loaded (remembered: a later call raises it again at once, building nothing)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        raise ValueError(f"KernelOptions({setting}='cuda') needs sm_80 or newer (cp.async, "
                         f"mma.sync on bf16); this GPU is sm_{major}{minor}: use 'triton'")
    key = (device_index, file_name, f"{major}{minor}", tuple(options))
    if key in _failed:
        raise _failed[key]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"Moira's CUDA kernel {name} loads at its first launch, which must "
                           f"not be inside a CUDA graph capture: run one step eagerly before "
                           f"capturing")
    with torch.cuda.device(device_index):
        torch.cuda.init()
        make_current(device_index)
        try:
            loaded = module(*key)
        except BuildError as error:
            _failed[key] = error
            raise
        handle = ctypes.c_void_p()
        check(driver().cuModuleGetFunction(ctypes.byref(handle), loaded, name.encode()),
              f"cuModuleGetFunction({name})", BuildError)
        # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: needed past 48 KB of static and
        # dynamic shared memory together (under it, the default allows only 48 KB less the
        # static part), so set for any dynamic use
        if dynamic_shared:
            check(driver().cuFuncSetAttribute(handle, 8, dynamic_shared), "cuFuncSetAttribute")
    return handle


def launch(handle, grid, threads, dynamic_shared, device, params):
    """Launch a loaded kernel on a ``grid`` of ``(x, y)`` blocks of ``threads`` threads, its one
    argument the ctypes structure ``params``, on the current stream of ``device`` (a
    torch.device); captured like any launch on that stream."""
    make_current(device_index(device))
    arguments = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    grid_x, grid_y = grid
    check(driver().cuLaunchKernel(handle, grid_x, grid_y, 1, threads, 1, 1, dynamic_shared,
                                  stream, arguments, None), "cuLaunchKernel")


def device_index(device):
    """The ordinal of a CUDA torch.device (the current device's where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def unusable(index):
    """Why this folder's kernels cannot be built for device ``index`` (None if they can): no
    libnvrtc, or an NVRTC that cannot target the GPU's architecture."""
    if nvrtc_library() is None:
        return ("no libnvrtc was found (pip install nvidia-cuda-nvrtc; torch's CUDA builds "
                "bring it)")
    major, minor = torch.cuda.get_device_capability(index)
    if not supports(f"{major}{minor}"):
        version = ".".join(map(str, nvrtc_version()))
        archs = supported_archs()
        return (f"NVRTC {version} cannot build for this GPU's sm_{major}{minor} (it targets "
                f"sm_{archs[0]} to sm_{archs[-1]}): install the nvidia-cuda-nvrtc wheel of a "
                f"CUDA version that supports sm_{major}{minor}, or point $CUDA_HOME at such a "
                f"toolkit")
    return None


@functools.lru_cache(maxsize=None)
def can_run(index, what):
    """Whether this folder's CUDA kernels can run on device ``index``: sm_80 or newer, and an
    NVRTC that can build for it (if not, warned once per ``what``, e.g. "Attend", whose Triton
    kernel then runs)."""
    if torch.cuda.get_device_properties(index).major < 8:
        return False
    reason = unusable(index)
    if reason:
        warnings.warn(f"{reason}: Moira's CUDA {what} cannot be built, and 'auto' runs "
                      f"Triton's instead", RuntimeWarning, stacklevel=3)
    return reason is None
