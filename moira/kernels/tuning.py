"""The kernels' tuning constants: one table of names, defaults and allowed values.

A workspace's kernels read them from its ``KernelOptions`` (``tuning={"attend.num_warps":
8}``), never from module globals, so two workspaces in one process may differ. Each default
was timed on the H200 against the alternatives listed on its stage's design page
(``docs/design/``); a constant marked with a backend is read only by that kernel.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tunable:
    """One constant: its default, what it may be (``choices``, or an int in ``[low, high]``,
    ``None`` where ``optional``), the only backend that reads it, and what it does."""

    default: object
    help: str
    choices: tuple = ()
    low: int | None = None
    high: int | None = None
    optional: bool = False
    backend: str | None = None

    def check(self, name, value):
        """``value`` as stored (ints from JSON floats refused), or a ValueError naming ``name``."""
        if value is None and self.optional:
            return None
        if self.choices:
            if isinstance(value, bool) is not isinstance(self.choices[0], bool) \
                    or value not in self.choices:
                raise ValueError(f"tuning {name!r} must be one of {self.choices}, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, int) \
                or not self.low <= value <= self.high:
            extra = " or None" if self.optional else ""
            raise ValueError(f"tuning {name!r} must be an int in [{self.low}, {self.high}]"
                             f"{extra}, got {value!r}")
        return value


_BOOL = (True, False)

TUNABLES = {
    # Attend (docs/design/attend.md)
    "attend.num_warps": Tunable(4, "warps per Triton Attend program", (1, 2, 4, 8, 16),
                                backend="triton"),
    "attend.num_stages": Tunable(2, "Triton's software-pipeline stages", low=1, high=8,
                                 backend="triton"),
    "attend.pages_per_iter": Tunable(2, "listed pages per inner-loop tile", (1, 2, 4),
                                     backend="triton"),
    "attend.max_registers": Tunable(None, "registers per thread (None: ptxas's choice)",
                                    low=24, high=255, optional=True, backend="triton"),
    "attend.sum_rounded_weights": Tunable(
        True, "softmax denominator over the weights as rounded for P @ V (False: FA3's)", _BOOL,
        backend="triton"),
    "attend.fa3_tile_order": Tunable(False, "FA3's tile order and rounding (a numerics study)",
                                     _BOOL, backend="triton"),
    "attend.even_chunks": Tunable(False, "a row's chunks of equal length", _BOOL,
                                  backend="triton"),
    "attend.page_ids_ahead": Tunable(False, "each tile's page ids loaded one tile ahead", _BOOL,
                                     backend="triton"),
    "attend.cuda_stages": Tunable(2, "pages in flight per CUDA Attend program", (2, 3, 4),
                                  backend="cuda"),
    # Estimate (docs/design/estimate.md)
    "estimate.pages_per_program": Tunable(32, "pages per mvar tile", (16, 32, 64),
                                          backend="triton"),
    "estimate.num_warps": Tunable(4, "warps per Triton Estimate program", (1, 2, 4, 8),
                                  backend="triton"),
    "estimate.max_registers": Tunable(96, "registers per thread at small groups (None: "
                                      "ptxas's choice)", low=24, high=255, optional=True,
                                      backend="triton"),
    "estimate.max_registers_group": Tunable(4, "largest group estimate.max_registers applies "
                                            "to", low=1, high=16, backend="triton"),
    "estimate.target_programs": Tunable(2048, "mvar programs over the batch", low=1,
                                        high=1 << 20, backend="triton"),
    "estimate.max_tiles_per_program": Tunable(8, "most tiles one mvar program loops over",
                                              low=1, high=1 << 16, backend="triton"),
    "estimate.exact_pages": Tunable("chained", "the exact pages' heads one after another or "
                                    "side by side", ("chained", "side by side"),
                                    backend="triton"),
    "estimate.query_head_ahead": Tunable(True, "each head's query loaded while the previous "
                                         "head computes", _BOOL, backend="triton"),
    "estimate.cuda_from_pages": Tunable(256, "estimate='auto': the narrowest block table the "
                                        "CUDA Estimate runs in", low=0, high=1 << 20),
    "estimate.cuda_target_programs": Tunable(660, "CUDA mvar programs over the batch", low=1,
                                             high=1 << 20, backend="cuda"),
    "estimate.cuda_min_blocks_per_sm": Tunable(5, "blocks per SM the CUDA build must fit (0: "
                                               "ptxas's choice)", low=0, high=16,
                                               backend="cuda"),
    "estimate.cuda_max_tiles_per_program": Tunable(8, "most tiles one CUDA mvar program loops "
                                                   "over", low=1, high=1 << 16, backend="cuda"),
    # Select (docs/design/select.md)
    "select.softmax_tile": Tunable(16384, "largest [G, lanes] tile whose softmaxes run side "
                                   "by side (0: head by head)", low=0, high=1 << 20,
                                   backend="triton"),
    "select.eight_warps_from": Tunable(2048, "table width (lanes) from which the Triton Select "
                                       "runs in 8 warps", low=1, high=1 << 20,
                                       backend="triton"),
    "select.num_warps": Tunable(0, "warps per Triton Select program (0: by the table's width)",
                                (0, 1, 2, 4, 8, 16), backend="triton"),
    "select.cuda_from_pages": Tunable(2048, "select='auto': the narrowest block table the CUDA "
                                      "Select runs in", low=0, high=1 << 20),
    # programmatic dependent launch (docs/design/work-split.md)
    "launch.chained": Tunable("estimate,select,attend,merge", "the Triton kernels chained "
                              "when MoiraConfig.programmatic_launch is on",
                              ("estimate,select,attend,merge", "estimate,select,merge",
                               "estimate,select")),
    # Estimate + Select in one launch (docs/design/select.md)
    "fused.min_rows": Tunable(256, "fused='auto': the fewest rows a step launches it for",
                              low=0, high=1 << 30),
    "fused.min_table_pages": Tunable(2048, "fused='auto': the narrowest block table it runs "
                                     "in", low=0, high=1 << 20),
}


def check(tuning):
    """``tuning`` (a mapping of names to values) as a sorted tuple of pairs, each checked."""
    try:
        items = dict(tuning).items()
    except (TypeError, ValueError):
        raise ValueError(f"tuning must be a mapping of names to values, got {tuning!r}") \
            from None
    pairs = []
    for name, value in items:
        if name not in TUNABLES:
            raise ValueError(f"unknown tuning {name!r}; known: {', '.join(sorted(TUNABLES))}")
        pairs.append((name, TUNABLES[name].check(name, value)))
    return tuple(sorted(pairs))


def parse_value(name, text):
    """A value of ``name`` from its text form (``"8"``, ``"true"``, ``"none"``, a word)."""
    if name not in TUNABLES:
        raise ValueError(f"unknown tuning {name!r}; known: {', '.join(sorted(TUNABLES))}")
    tunable, word = TUNABLES[name], text.strip().lower()
    if tunable.optional and word == "none":
        return None
    if tunable.choices and isinstance(tunable.choices[0], bool):
        if word in ("1", "true", "on", "yes"):
            return True
        if word in ("0", "false", "off", "no"):
            return False
    elif tunable.choices and isinstance(tunable.choices[0], str):
        return text.strip()
    try:
        return int(word)
    except ValueError:
        return text.strip()  # refused by the check, with the name
