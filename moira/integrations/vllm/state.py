"""Per-layer state the plugin keeps beside vLLM's KV cache (tested on CPU).

- **Page summaries**: ``[num_blocks, num_kv_heads, rows, head_dim]`` in the cache's dtype
  (``config.summary_rows``: 2 for mvar), one per attention layer, allocated on first use
  *outside* the memory vLLM reserves for the KV cache (``settings.summary_bytes``: 1/64 of
  the K+V cache for mvar, 5/64 for int2, 9/64 for int4; lower ``--gpu-memory-utilization``
  by that share of the cache if memory is tight: an allocation that fails says so). Written
  for every page a step completes, by a kernel inside the step (prefill, chunked prefill and
  decode alike), and never zeroed again: a buffer
  allocated or zeroed during CUDA-graph capture would be re-zeroed by every replay, so that
  is refused with an error.
- **Page counters**: int64 ``[2]`` per layer (pages read, pages present, summed over decode
  rows), added to on the GPU by Merge, read by ``PageStatsLog`` every ``stats_interval`` s.
- **Dense check** (``check_dense``, debugging): per layer, how Moira's output compares with
  dense FA3 run on the same batch, accumulated on the GPU (graph-safe).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ...benchmarking.imposed import imposed_fractions
from ...config import summary_rows
from ...synthetic import layer_head_fractions

logger = logging.getLogger("moira")


def not_capturing(what):
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"Moira: {what} would be allocated during CUDA-graph capture, where every replay "
            "would zero it again. This means no eager step ran before capture; please report "
            "it with your vLLM command line.")


class LayerState:
    """The summaries and counters of one attention layer."""

    def __init__(self, layer_name: str, with_stats: bool):
        self.layer_name = layer_name
        self.with_stats = with_stats
        self.summaries: torch.Tensor | None = None
        self.page_stats: torch.Tensor | None = None
        self._cache_ptr = None

    def summaries_for(self, kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                      estimator: str) -> torch.Tensor:
        """The summary buffer that belongs to ``kv_cache`` (vLLM's ``[num_blocks, ...]``
        tensor); (re)allocated, zeroed, when the cache is new (first use, or a re-bound cache,
        whose old summaries describe pages that no longer exist)."""
        if self.summaries is None or self._cache_ptr != kv_cache.data_ptr():
            not_capturing(f"the page-summary buffer of {self.layer_name}")
            rows = summary_rows(estimator, kv_cache.element_size())
            shape = (kv_cache.shape[0], num_kv_heads, rows, head_dim)
            try:
                self.summaries = torch.zeros(shape, dtype=kv_cache.dtype,
                                             device=kv_cache.device)
            except torch.OutOfMemoryError:
                share = rows * head_dim / (2 * 64 * head_dim)  # of the layer's K+V cache
                raise RuntimeError(
                    f"Moira: no memory for the page summaries of {self.layer_name} "
                    f"({math.prod(shape) * kv_cache.element_size() / 2**20:.0f} MiB, "
                    f"{share:.1%} of its KV cache, estimator={estimator!r}), which live "
                    f"beside vLLM's cache: lower --gpu-memory-utilization by about "
                    f"{share * 0.9:.2f} (or use estimator='mvar', 1.6%)") from None
            self._cache_ptr = kv_cache.data_ptr()
            if self.with_stats and self.page_stats is None:
                self.page_stats = torch.zeros(2, dtype=torch.int64, device=kv_cache.device)
                PageStatsLog.layers[self.layer_name] = self.page_stats
        return self.summaries


class ImposedFractions:
    """Read fractions for the imposed-budget mode: ``layer_head_fractions`` tables at each knot
    ``(context_tokens, mean)``, interpolated per request in log context length into a persistent
    ``[num_layers, max_batch, num_kv_heads]`` buffer (so graphs captured on its views see each
    step's values)."""

    def __init__(self, knots, num_layers, num_kv_heads, max_batch, device):
        self.log_tokens = torch.tensor([math.log(tokens) for tokens, _ in knots],
                                       dtype=torch.float32, device=device)
        self.tables = torch.stack([layer_head_fractions(mean, num_layers, num_kv_heads)
                                   for _, mean in knots]).to(device)  # [knots, layers, heads]
        self.buffer = torch.zeros(num_layers, max_batch, num_kv_heads, dtype=torch.float32,
                                  device=device)

    def fill(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Write the fractions of requests with these lengths (``reference.imposed_fractions``,
        one kernel launch); returns ``[layers, rows, heads]``, a view of the buffer."""
        return imposed_fractions(seq_lens, self.log_tokens, self.tables, self.buffer)


def bf16_ulps(value: torch.Tensor, reference: torch.Tensor,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """|value - reference| in units of the bf16 spacing at |reference| (float32), or at
    ``scale`` (broadcast against it) where given."""
    reference = reference.float()
    at = reference.abs() if scale is None else scale.float().abs().expand_as(reference)
    _, exponent = torch.frexp(at.clamp_min(2.0 ** -126))
    spacing = torch.ldexp(torch.ones_like(reference), exponent - 8)  # 8 significant bits
    return (value.float() - reference).abs() / spacing


class DenseCheck:
    """Per-layer float64 counters (``NAMES``) comparing, on every batch, Moira's decode rows with
    dense FA3's and, as the yardstick, FA3 with its split heuristic with FA3 in one split (two
    correct kernels that differ only in summation order); the other rows (prefill, computed by
    FA3 in both: in the engine as ``exact_prefill`` says, here dense vLLM's call on the whole
    batch, with ``exact_prefill`` built with the engine's schedule but without its decode rows'
    key lengths zeroed, so the count checks that zeroing them changes no other row)
    are counted bitwise (with FA3 on the batch without its decode rows: 0 in every
    Llama-geometry run, 0.8% of SmolLM2-135M's elements, from FA3's per-launch scheduling;
    docs/design/vllm-integration.md).

    Ulps are counted at each element's own magnitude (strict: an element near zero has a tiny
    spacing) and, as the paper's Appendix B states its bound, at the scale of the head's output
    (the bf16 spacing at the largest |value| of that head's vector); ``*_max_abs`` is the
    largest absolute difference. With ``decode_exact`` (float32 attention over every page, the
    package's reference), each of Moira, FA3 and FA3 in one split is also measured against the
    exact result (``*_exact_abs_sum``, ``*_exact_max_abs``): which of the two kernels rounds
    closer to the truth, not only how far apart they are; ``*_exact_outward_sum`` sums the
    error along the exact value's sign, (value - exact) * sign(exact): a kernel whose outputs
    lean toward or away from zero shows a sum far from zero where unbiased rounding cancels.
    (The result files of the FA3 split study also hold ``other_rows_differing_one_split`` and
    ``other_rows_split_in_whole_batch``, the counters that traced the prefill rows'
    differences to FA3's split choice.)"""

    NAMES = ("moira_max_ulps", "moira_over_1_ulp", "moira_over_4_ulps", "decode_elements",
             "fa3_split_max_ulps", "fa3_split_over_1_ulp", "fa3_split_over_4_ulps",
             "other_rows_differing", "other_elements",
             "moira_max_abs", "moira_over_1_head_ulp", "fa3_split_max_abs",
             "fa3_split_over_1_head_ulp",
             "moira_exact_abs_sum", "fa3_exact_abs_sum", "fa3_split_exact_abs_sum",
             "moira_exact_max_abs", "fa3_exact_max_abs", "fa3_split_exact_max_abs",
             "moira_exact_outward_sum", "fa3_exact_outward_sum", "fa3_split_exact_outward_sum")
    layers: dict[str, torch.Tensor] = {}

    @classmethod
    def add(cls, layer_name, decode_out, decode_dense, decode_dense_one_split, other_out,
            other_dense, decode_exact=None):
        counters = cls.layers.get(layer_name)
        if counters is None:
            not_capturing(f"the dense-check counters of {layer_name}")
            counters = cls.layers[layer_name] = torch.zeros(len(cls.NAMES), dtype=torch.float64,
                                                            device=decode_out.device)
        head_scale = (decode_dense.float().abs().amax(-1, keepdim=True)
                      if decode_dense.numel() else None)
        for first, extra, value in ((0, 9, decode_out), (4, 11, decode_dense_one_split)):
            ulps = bf16_ulps(value, decode_dense)
            if ulps.numel():
                counters[first] = torch.maximum(counters[first], ulps.max().double())
                difference = (value.float() - decode_dense.float()).abs().max().double()
                counters[extra] = torch.maximum(counters[extra], difference)
                counters[extra + 1] += (bf16_ulps(value, decode_dense, head_scale) > 1).sum()
            counters[first + 1] += (ulps > 1).sum()
            counters[first + 2] += (ulps > 4).sum()
        counters[3] += decode_out.numel()
        counters[7] += (other_out != other_dense).sum()
        counters[8] += other_out.numel()
        if decode_exact is not None and decode_exact.numel():
            for total, worst, outward, value in ((13, 16, 19, decode_out),
                                                 (14, 17, 20, decode_dense),
                                                 (15, 18, 21, decode_dense_one_split)):
                error = value.float() - decode_exact.float()
                counters[total] += error.abs().sum().double()
                counters[worst] = torch.maximum(counters[worst], error.abs().max().double())
                counters[outward] += (error * decode_exact.float().sign()).double().sum()

    @classmethod
    def read(cls) -> dict[str, dict[str, float]]:
        return {name: dict(zip(cls.NAMES, counters.tolist()))
                for name, counters in cls.layers.items()}


class PageStatsLog:
    """Logs the fraction of KV pages decode steps read, every ``interval`` seconds.

    ``layers`` maps layer name -> int64 ``[2]`` counters on the GPU. ``maybe_log`` is called on
    the host once per step; reading the counters synchronizes with the GPU, which happens only
    when a line is due.
    """

    layers: dict[str, torch.Tensor] = {}

    def __init__(self, interval: float, clock=time.monotonic, log=logger.info, note=""):
        self.interval = interval
        self.note = note
        self.clock = clock
        self.log = log
        self.last_time = clock()
        self.last_totals: dict[str, tuple[int, int]] = {}

    def read(self) -> dict[str, tuple[int, int]]:
        """Cumulative (pages read, pages present) per layer since start."""
        if not self.layers:
            return {}
        names = list(self.layers)
        values = torch.stack([self.layers[name] for name in names]).tolist()
        return {name: (read, present) for name, (read, present) in zip(names, values)}

    def maybe_log(self) -> str | None:
        if self.interval <= 0 or self.clock() - self.last_time < self.interval:
            return None
        self.last_time = self.clock()
        totals = self.read()
        deltas = {name: (read - self.last_totals.get(name, (0, 0))[0],
                         present - self.last_totals.get(name, (0, 0))[1])
                  for name, (read, present) in totals.items()}
        self.last_totals = totals
        fractions = [read / present for read, present in deltas.values() if present]
        if not fractions:
            return None
        read = sum(r for r, _ in deltas.values())
        present = sum(p for _, p in deltas.values())
        line = (f"Moira: decode steps read {read / present:.1%} of their KV pages over the last "
                f"{self.interval:g} s (per layer: min {min(fractions):.1%}, max "
                f"{max(fractions):.1%}; {len(fractions)} layers){self.note}")
        self.log(line)
        return line
