"""Imposed read fractions (timing runs with random weights): per decode row, the
per-(layer, KV head) fractions of pages to keep, interpolated in log context length between
knots ``(log_tokens[k], tables[k])`` and clamped outside them (``reference.imposed_fractions``).

One program per row writes ``fractions[:, row, :]``. Why a kernel: the plugin fills these
before every decode step, outside the captured graph, and the same arithmetic as PyTorch ops
put ~18 small kernels on the GPU's stream per step (predicted ~2 us each, ~0.7% of a 5 ms
step), a cost of the timing harness that neither dense vLLM nor Moira's coverage mode pays;
this is one launch. TPOT pairs showed no effect of it beyond the host-to-host spread (~1 point
at batch 1; docs/design/vllm-integration.md).
"""

import triton
import triton.language as tl

from ..kernels import launch


@triton.jit
def _imposed_fractions_kernel(seq_lens, log_tokens, tables, fractions, num_knots,
                              num_heads, entries, stride_tk, stride_fl, stride_fb,
                              KNOTS: tl.constexpr, ENTRIES: tl.constexpr):
    row = tl.program_id(0)
    x = tl.log(tl.maximum(tl.load(seq_lens + row), 1).to(tl.float32))
    knots = tl.arange(0, KNOTS)
    log_knots = tl.load(log_tokens + knots, mask=knots < num_knots, other=float("inf"))
    # the interval [lower, upper] that holds x (torch.searchsorted, clamped to the outer
    # intervals; with one knot both are 0)
    upper = tl.minimum(tl.maximum(tl.sum((log_knots < x).to(tl.int32), axis=0), 1),
                       num_knots - 1)
    lower = tl.maximum(upper - 1, 0)
    at_lower = tl.load(log_tokens + lower)
    at_upper = tl.load(log_tokens + upper)
    span = tl.where(upper > lower, at_upper - at_lower, 1.0)
    alpha = tl.where(upper > lower, (x - at_lower) / span, 0.0)
    alpha = tl.minimum(tl.maximum(alpha, 0.0), 1.0)
    # a knot's table is [layers, heads], contiguous: entry e is (e // heads, e % heads)
    e = tl.arange(0, ENTRIES)
    valid = e < entries
    below = tl.load(tables + lower * stride_tk + e, mask=valid, other=0.0)
    above = tl.load(tables + upper * stride_tk + e, mask=valid, other=0.0)
    layer, head = e // num_heads, e % num_heads
    tl.store(fractions + layer * stride_fl + row * stride_fb + head,
             below * (1 - alpha) + above * alpha, mask=valid)


def imposed_fractions(seq_lens, log_tokens, tables, out):
    """Write ``out[:, :rows, :]`` (float32 ``[layers, >= rows, heads]``, last dim contiguous)
    for ``seq_lens`` (int32 ``[rows]``), from ``log_tokens`` (float32 ``[knots]``,
    increasing) and ``tables`` (float32 ``[knots, layers, heads]``, contiguous)."""
    rows = seq_lens.shape[0]
    num_knots, layers, heads = tables.shape
    if rows:
        launch.on(_imposed_fractions_kernel, (rows,))(
            seq_lens, log_tokens, tables, out, num_knots, heads, layers * heads,
            tables.stride(0), out.stride(0), out.stride(1),
            KNOTS=triton.next_power_of_2(num_knots),
            ENTRIES=triton.next_power_of_2(layers * heads), num_warps=4)
    return out[:, :rows]
