"""Moira: sparse long-context decoding that reads only the KV-cache pages a query needs.

Per (request, KV head) row and step, Moira estimates every page's attention mass from a
per-page summary of its keys (mean and variance), keeps the fewest pages whose estimated mass
reaches gamma, and attends over those ragged page lists with kernels that plan their own work
on the GPU, so the whole step fits in a CUDA graph.
"""

import importlib

__version__ = "0.1.0"

# Names resolve on first use: Triton decides at kernel-definition time whether to run on the GPU
# or in its CPU interpreter, so the CLI must be able to choose before any kernel module loads.
_EXPORTS = {
    "PAGE_SIZE": "config",
    "MoiraConfig": "config",
    "KernelOptions": "config",
    "DecodeWorkspace": "decode",
    "attend": "decode",
    "sparse_decode": "decode",
    "summarize": "decode",
    "update_summaries": "decode",
    "reference": None,
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moira' has no attribute {name!r}")
    module = importlib.import_module(f".{_EXPORTS[name] or name}", __name__)
    return module if _EXPORTS[name] is None else getattr(module, name)


def __dir__():
    return __all__
