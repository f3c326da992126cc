"""How Moira's launchers launch: ``on(kernel, grid)`` (or, inside ``build_only()``, only build
the kernel), and programmatic dependent launch (PDL, sm_90+) between the kernels of a step.

Estimate -> Select -> Attend -> Merge run back to back, each a few microseconds for a short
request, so a layer pays each kernel's launch and ramp in series. With PDL a kernel may be
scheduled while the one before it drains: every program first lets the next kernel launch
(``griddepcontrol.launch_dependents``: the next kernel launches once every program of this one
has issued it or exited, so at once for a one-wave kernel, during the last wave otherwise) and
then waits until the previous kernel has finished and its writes are visible
(``griddepcontrol.wait``). Every program waits, even one that then exits without reading:
that is what keeps the chain ordered (a kernel cannot finish before the one ahead of it, so
Attend, which may launch while Estimate still runs, cannot read lists Select has not written,
nor K/V before the cache write that precedes Estimate). Nothing may move above the wait. Off by
default (``MoiraConfig.programmatic_launch``): the paper measured no clear TPOT change at batch
shapes, and at batch 1 in vLLM it gave -1.4 / -1.1% TPOT at 2k / 8k tokens but +2.2% at 16k
against plain Moira with one engine per arm, then +1.3 / +1.3% and -2.8% in interleaved
pairs: no stable gain (docs/design/work-split.md).
"""

import contextlib
import contextvars
import functools

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import interpreting

# per thread (and task): a launch on another thread while one builds must still launch
_building_only = contextvars.ContextVar("moira_building_only", default=False)


@contextlib.contextmanager
def build_only():
    """Inside, Moira's launchers build each kernel for the arguments they are given (Triton's
    ``warmup``: the specialization a launch with them would get) and launch nothing. The vLLM
    plugin builds this way, during warm-up, the kernels that only mixed steps launch, which
    vLLM's warm-up and graph capture never run."""
    token = _building_only.set(True)
    try:
        yield
    finally:
        _building_only.reset(token)


def building_only() -> bool:
    """Whether launchers only build (inside ``build_only()``)."""
    return _building_only.get()


def on(kernel, grid):
    """``kernel[grid]``, or only its build inside ``build_only()``."""
    return functools.partial(kernel.warmup, grid=grid) if building_only() else kernel[grid]


# the kernels chained when programmatic launch is on (tuning "launch.chained"); the others
# launch plainly (their programs neither trigger nor wait, and the stream orders them). All
# four by default: in vLLM a chained
# kernel can only overlap the decode-step kernel before it (the GEMMs between layers launch
# plainly), and chaining Estimate and Select alone, which is what leaving Attend out leaves in
# vLLM, saved nothing (measured on the H200 at batch 1, rows read in full: 16.8 / 22.3 / 30.5
# us per layer at 2k / 8k / 16k against 16.7 / 22.2 / 30.6 plain; docs/design/work-split.md)
CHAINED = "estimate,select,attend,merge"


def options(programmatic: bool, kernel: str, chained: str = CHAINED) -> dict:
    """Keywords for the launch of decode-step ``kernel``: the ``PDL`` constexpr its programs
    branch on, and Triton's ``launch_pdl`` (the interpreter runs neither); ``chained``: the
    comma-separated kernels that take part (``"launch.chained"``)."""
    chained = bool(programmatic) and kernel in chained.split(",") and not interpreting()
    return dict(PDL=True, launch_pdl=True) if chained else dict(PDL=False)


@triton.jit
def after_previous_kernel(PDL: tl.constexpr):
    """A program's first statement: with PDL, let the next kernel launch, then wait for the
    previous one's writes. Without PDL, nothing (the launch itself waited)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
