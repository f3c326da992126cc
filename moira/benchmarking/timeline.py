"""Timeline probes of the CUDA kernels: while ``recording(stage, buffer)`` is active, that
stage's launches run their probe build, which writes per program the global timer (ns) at
fixed points of its work into ``buffer`` (int64, ``[programs, FIELDS]``).

    with timeline.recording("attend", buffer):   # buffer: [rows * chunks_per_row, 8]
        moira.attend(...)                         # each program: start, first page, end, ...

Stages: ``"attend"`` (per program: start, first page landed and end on the global timer, the
same on its SM's clock in cycles, its SM and its page count; programs = rows x chunks, row
fastest) and ``"estimate_select"`` (per row: start, after the token's write, after group 0's
exact page and mvar tiles, after group 1's, before Select and at its end). A field a program
did not reach keeps its value. ``benchmarks/`` analyses them.
"""

import contextlib
import contextvars

FIELDS = 8
STAGES = ("attend", "estimate_select")

_buffers = contextvars.ContextVar("moira_timeline_buffers", default={})


@contextlib.contextmanager
def recording(stage, buffer):
    """Run ``stage``'s launches in this context with its probe build writing into ``buffer``."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    token = _buffers.set({**_buffers.get(), stage: buffer})
    try:
        yield buffer
    finally:
        _buffers.reset(token)


def buffer(stage, programs):
    """The buffer ``stage``'s launch of ``programs`` programs records into, or None: checked
    to be a contiguous int64 tensor of at least ``[programs, FIELDS]``."""
    found = _buffers.get().get(stage)
    if found is not None and (found.dtype.itemsize != 8 or not found.dtype.is_signed
                              or found.dtype.is_floating_point or not found.is_contiguous()
                              or found.numel() < programs * FIELDS):
        raise ValueError(f"the {stage} timeline must be a contiguous int64 tensor of at least "
                         f"[{programs}, {FIELDS}], got {found.dtype} {tuple(found.shape)}")
    return found
