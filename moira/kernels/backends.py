"""Which kernel runs each stage: ``KernelOptions``' choices resolved once for a workspace's
device and shapes, then per call for the tensors at hand.

A workspace resolves each stage to "cuda" where the device can build and run the CUDA kernel
(a CUDA device of sm_80+, a libnvrtc that can target its architecture) and its shapes fit
(head dim, group, Attend's "rows" schedule), else to "triton"; an explicit "cuda" that cannot
run there is a ValueError then, not at the first step. Per call the CUDA kernels also need
bf16 tensors with aligned strides: "auto" runs the Triton kernel on others (warning once per
reason), "cuda" raises.
"auto" also picks by the block table's width for Estimate and Select, where the CUDA kernel
wins only from ``estimate.cuda_from_pages`` / ``select.cuda_from_pages`` pages (why:
docs/design/cuda-backend.md). A CUDA kernel that fails to build or load at its first launch
(``build.BuildError``) is the Triton kernel's under "auto" from then on (``build_failed``,
warned once), the error under "cuda".
"""

from __future__ import annotations

import warnings

import torch

from .cuda import attend as cuda_attend
from .cuda import build
from .cuda import estimate as cuda_estimate
from .cuda import estimate_select as cuda_estimate_select
from .cuda import select as cuda_select

STAGES = ("estimate", "select", "attend")


def _device_reason(device):
    """Why no CUDA kernel can run on ``device`` (None if one can)."""
    if device.type != "cuda":
        return f"the tensors are on {device}, not a CUDA device"
    index = build.device_index(device)
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"the GPU is sm_{major}{minor}; the CUDA kernels need sm_80 or newer"
    return build.unusable(index)


def _stage_reason(stage, options, device, head_dim, group, schedule, estimator):
    """Why ``stage``'s CUDA kernel cannot run a workspace of these shapes (None if it can)."""
    reason = _device_reason(device)
    if reason:
        return reason
    if stage == "estimate" and estimator != "mvar":
        return f"estimator={estimator!r}: the CUDA Estimate computes mvar"
    if stage == "attend":
        if schedule != "rows":
            return f"schedule={schedule!r}: the CUDA Attend runs the 'rows' schedule"
        heads, most = cuda_attend.HEAD_DIMS, cuda_attend.MAX_GROUP
    elif stage == "estimate":
        heads, most = cuda_estimate.HEAD_DIMS, cuda_estimate.MAX_GROUP
    else:
        heads, most = None, cuda_select.MAX_GROUP
    if heads is not None and head_dim not in heads:
        return f"head_dim {head_dim}: the CUDA {stage} is built for {heads}"
    if group > most:
        return f"{group} query heads per KV head: the CUDA {stage} takes at most {most}"
    if stage == "attend" and not cuda_attend.usable(build.device_index(device), head_dim,
                                                    options.value("attend.cuda_stages")):
        return (f"attend.cuda_stages={options.value('attend.cuda_stages')} needs more shared "
                f"memory than this GPU allows")
    return None


def resolve(options, device, head_dim, group, schedule, estimator="mvar"):
    """``{"estimate", "select", "attend": "cuda" | "triton", "fused": "auto" | "on" | "off"}``
    for a workspace (``DecodeWorkspace.backends``); a ValueError for an explicit "cuda" that
    cannot run on ``device`` at these shapes."""
    device = torch.device(device)
    resolved = {}
    for stage in STAGES:
        choice = getattr(options, stage)
        reason = None if choice == "triton" else _stage_reason(
            stage, options, device, head_dim, group, schedule, estimator)
        if choice == "cuda" and reason:
            raise ValueError(f"KernelOptions({stage}='cuda') cannot run here: {reason}; use "
                             f"{stage}='auto' or 'triton'")
        resolved[stage] = "cuda" if choice != "triton" and not reason else "triton"
        if choice == "auto" and reason and device.type == "cuda":
            unbuildable = build.unusable(build.device_index(device))
            if unbuildable and reason == unbuildable:  # a GPU the CUDA kernels cannot build for
                _warn_once(f"Moira's CUDA kernels cannot be built here: {unbuildable}; 'auto' "
                           f"runs the Triton kernels")
    # the fused kernel runs the CUDA Estimate's and Select's code, whichever Select is chosen
    select_code = _stage_reason("select", options, device, head_dim, group, schedule,
                                estimator) is None
    fusable = resolved["estimate"] == "cuda" and select_code
    resolved["fused"] = options.fused if fusable else "off"
    return resolved


_warned = set()


def _warn_once(message, stacklevel=4):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _fall_back(stage, choice, error):
    """"triton" for a call the CUDA kernel cannot take under "auto" (warned once per reason);
    the kernel's ValueError under an explicit "cuda"."""
    if choice == "cuda":
        raise error
    _warn_once(f"{stage}='auto' runs the Triton kernel for these inputs: {error}")
    return "triton"


def build_failed(workspace, stage, error):
    """After ``stage``'s CUDA kernel failed to build or load (``error``, a ``build.BuildError``)
    at a launch: under "auto" the workspace runs the Triton kernel for the stage from now on
    (warned once) and this returns "triton"; under "cuda" the error is raised. ``stage``
    "fused": the fused Estimate + Select, off from now on ("off"; raised under ``fused="on"``),
    the two kernels running instead."""
    options = workspace.config.kernels
    if stage == "fused":
        if options.fused == "on":
            raise error
        workspace.backends["fused"] = "off"
        _warn_once(f"the fused CUDA Estimate + Select could not be built, and the two kernels "
                   f"run instead: {error}")
        return "off"
    if getattr(options, stage) == "cuda":
        raise error
    workspace.backends[stage] = "triton"
    _warn_once(f"{stage}='auto' runs the Triton kernel: the CUDA kernel could not be built "
               f"or loaded: {error}")
    return "triton"


def attend(workspace, query, key_cache, value_cache):
    """The Attend that runs a call, "cuda" or "triton"."""
    if workspace.backends["attend"] == "triton":
        return "triton"
    options = workspace.config.kernels
    try:
        cuda_attend.check_inputs(query, key_cache, value_cache, query.shape[2],
                                 query.shape[1] // key_cache.shape[2],
                                 options.value("attend.cuda_stages"))
    except ValueError as error:
        return _fall_back("attend", options.attend, error)
    return "cuda"


def estimate(workspace, query, key_cache, summaries, block_table, seq_lens, new_kv,
             log_masses):
    """The Estimate that runs a call, "cuda" or "triton"."""
    options = workspace.config.kernels
    if workspace.backends["estimate"] == "triton" or (
            options.estimate == "auto"
            and block_table.shape[1] < options.value("estimate.cuda_from_pages")):
        return "triton"
    try:
        cuda_estimate.check_inputs(query, key_cache, summaries, block_table, seq_lens, new_kv,
                                   log_masses)
    except ValueError as error:
        return _fall_back("estimate", options.estimate, error)
    return "cuda"


def _select_takes(log_masses, seq_lens, page_lists, page_counts, max_pages, ways, row_values):
    try:
        cuda_select.check_inputs(log_masses, seq_lens, page_lists, page_counts, max_pages, ways,
                                 row_values)
    except ValueError as error:
        return error
    return None


def select(workspace, log_masses, seq_lens, page_lists, page_counts, max_pages, ways,
           row_values):
    """The Select that runs a call, "cuda" or "triton"."""
    options = workspace.config.kernels
    if workspace.backends["select"] == "triton" or (
            options.select == "auto" and max_pages < options.value("select.cuda_from_pages")):
        return "triton"
    error = _select_takes(log_masses, seq_lens, page_lists, page_counts, max_pages, ways,
                          row_values)
    return _fall_back("select", options.select, error) if error else "cuda"


def fused(workspace, estimate_runs, log_masses, seq_lens, page_lists, page_counts, max_pages,
          ways, row_values, programmatic_launch):
    """Whether Estimate and Select run as one launch: the workspace allows it, this call's
    Estimate runs in CUDA, the mode and shape rule hold (``estimate_select.applies``) and the
    CUDA Select's code can take the call (an optimization: never an error)."""
    if workspace.backends["fused"] == "off" or estimate_runs != "cuda":
        return False
    rows, group = log_masses.shape[0], log_masses.shape[1]
    return cuda_estimate_select.applies(rows, max_pages, group, ways, programmatic_launch,
                                        workspace.config.kernels) \
        and _select_takes(log_masses, seq_lens, page_lists, page_counts, max_pages, ways,
                          row_values) is None
