"""Moira's parameters: the coverage target and the kernels' work-split constants.

The defaults are the paper's (section 3.3), C = 24, N_J = 32, N_T = 4096, except the K_B
schedule, tuned on the H200 (docs/design/select.md): K_B = 8, 4, 2 thresholds per bisection
pass for block tables of fewer than 256, 4,096 and more pages (the paper switches to 2 at
1,024), and a ceiling of 128 on J, Eq. (4)'s programs per row (docs/design/work-split.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

from .kernels import tuning as _tuning

PAGE_SIZE = 64
"""Tokens per KV-cache page. Summaries and the estimate are defined per 64-token page."""

BISECTION_BITS = 24
"""Select shrinks the threshold interval 2**24-fold: passes = 24 / log2(K_B)."""

MAX_PAGES_PER_SEQ = 32768
"""Longest row Select keeps on chip (2M tokens)."""

MAX_WAYS = 256
"""Largest K_B: a bisection pass compares K_B thresholds with every page of the row on chip."""

MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second dimension: Attend's programs per row."""

MAX_PROGRAMS = 1 << 20
"""Ceiling on the program counts and the chunk size a config may ask for (the workspace's
partials are sized by them; the kernels plan in int32)."""

SUPPORTED_HEAD_DIMS = (64, 128)
"""Head dims the kernels are built and tested for."""

CACHE_DTYPE_NAMES = ("bfloat16", "float16")
"""KV-cache dtypes the kernels read (torch's names; vLLM's ``--kv-cache-dtype`` takes them)."""


ESTIMATOR_BITS = {"mvar": 0, "int2": 2, "int4": 4}
"""Page-mass estimators and the bits per key channel of their codes (docs/design/estimate.md):
``"mvar"`` the paper's mean-and-variance estimate (Eq. 2); ``"int2"`` / ``"int4"`` every key of
the page at 2 / 4 bits per channel between the page's per-channel min and max, each page's
mass the log-sum-exp of its keys' logits."""


def summary_rows(estimator: str, itemsize: int) -> int:
    """Rows of one (page, KV head) summary ``[rows, head_dim]`` in a dtype of ``itemsize`` bytes.

    ``"mvar"``: 2 (per-channel mean, population variance). ``"int2"`` / ``"int4"``: per-channel
    min and max, then the 64 keys' codes as bytes (``64 * head_dim * bits / 8`` of them, i.e.
    ``8 * bits / itemsize`` rows): token t's codes fill bytes ``[t * head_dim * bits / 8, ...)``
    and byte j holds channels ``j + s * head_dim * bits / 8`` at bits ``[s * bits, (s + 1) *
    bits)``, s = 0 .. 8 / bits - 1. E.g. int2 in bf16: 2 + 8 rows, 2,560 bytes at D = 128.
    """
    bits = ESTIMATOR_BITS[estimator]
    return 2 + 8 * bits // itemsize


BACKENDS = ("auto", "triton", "cuda")
"""A stage's implementations: ``"auto"`` runs the CUDA kernel where it can, Triton elsewhere."""

FUSED_MODES = ("auto", "on", "off")
"""Estimate + Select in one CUDA launch: ``"auto"`` where it was timed faster, always, never."""


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Which kernel runs each stage, and the kernels' tuning constants; validated on creation.

    Parameters
    ----------
    estimate, select, attend:
        ``"auto"``, ``"triton"`` or ``"cuda"``. ``"cuda"`` runs the CUDA C++ kernel (built by
        NVRTC on first use; sm_80+, bfloat16, head_dim 64 / 128) and raises a ValueError for
        a call it cannot run; ``"triton"`` runs the Triton kernel (any GPU, float16, the CPU
        interpreter); ``"auto"`` picks per call: the CUDA kernel where it can run and, for
        Estimate and Select, where the block table has at least ``estimate.cuda_from_pages``
        / ``select.cuda_from_pages`` pages, Triton elsewhere. The resolved choice for a
        workspace's device is ``DecodeWorkspace.backends``. Defaults: docs/design/.
    fused:
        ``"auto"``, ``"on"`` or ``"off"``: Estimate and Select in one CUDA launch where the
        Estimate runs in CUDA and the CUDA Select can take the step (it then replaces the
        configured Select). ``"auto"``: in steps of at least ``fused.min_rows`` rows and block
        tables of at least ``fused.min_table_pages`` pages.
    tuning:
        ``{name: value}`` overrides of the kernels' tuning constants, e.g.
        ``{"attend.num_warps": 8}``; names, defaults and allowed values are
        ``moira.kernels.tuning.TUNABLES``. Stored as a sorted tuple of pairs (hashable).
    """

    estimate: str = "auto"
    select: str = "triton"
    attend: str = "auto"
    fused: str = "auto"
    tuning: tuple = ()

    def __post_init__(self):
        for stage in ("estimate", "select", "attend"):
            if getattr(self, stage) not in BACKENDS:
                raise ValueError(f"KernelOptions.{stage} must be one of {BACKENDS}, got "
                                 f"{getattr(self, stage)!r}")
        if self.fused not in FUSED_MODES:
            raise ValueError(f"KernelOptions.fused must be one of {FUSED_MODES}, got "
                             f"{self.fused!r}")
        object.__setattr__(self, "tuning", _tuning.check(self.tuning))
        for name, _ in self.tuning:  # a kernel's constant tunes that kernel: name it
            stage, backend = name.split(".")[0], _tuning.TUNABLES[name].backend
            chosen = getattr(self, stage, None)
            if backend is not None and chosen != backend:
                raise ValueError(f"tuning {name!r} is read only by the {backend} kernel, and "
                                 f"{stage}={chosen!r}: set {stage}={backend!r} or drop it")

    @functools.cached_property
    def _values(self):
        return dict(self.tuning)

    def value(self, name):
        """The tuning constant ``name``: its override, else its default."""
        values = self._values
        return values[name] if name in values else _tuning.TUNABLES[name].default

    @classmethod
    def parse(cls, text):
        """Options from ``"attend=cuda,fused=off,attend.num_warps=8"`` (the vLLM plugin's
        ``MOIRA_KERNELS``; an empty string gives the defaults)."""
        fields, tuning = {}, {}
        for item in filter(None, (part.strip() for part in str(text).split(","))):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key:
                raise ValueError(f"kernel option {item!r}: use NAME=VALUE, e.g. attend=cuda "
                                 f"or attend.num_warps=8")
            if "." in key:
                tuning[key] = _tuning.parse_value(key, value)
            elif key in ("estimate", "select", "attend", "fused"):
                fields[key] = value
            else:
                raise ValueError(f"kernel option {key!r}: use estimate, select, attend, fused "
                                 f"or a tuning name such as attend.num_warps")
        return cls(**fields, tuning=tuning)

    @classmethod
    def from_mapping(cls, mapping):
        """Options from ``{"attend": "cuda", "tuning": {"attend.cuda_stages": 3}}`` (JSON)."""
        if isinstance(mapping, cls):
            return mapping
        if not isinstance(mapping, dict):
            raise ValueError(f"kernels must be a mapping such as {{\"attend\": \"cuda\"}}, "
                             f"got {mapping!r}")
        unknown = set(mapping) - {"estimate", "select", "attend", "fused", "tuning"}
        if unknown:
            raise ValueError(f"kernels: unknown keys {sorted(unknown)}; use estimate, select, "
                             f"attend, fused, tuning")
        return cls(**mapping)

    def describe(self):
        """The options as one line: the stages' settings and the tuning that differs."""
        text = f"estimate={self.estimate} select={self.select} attend={self.attend} " \
               f"fused={self.fused}"
        return text + "".join(f" {name}={value}" for name, value in self.tuning)


@dataclasses.dataclass(frozen=True)
class MoiraConfig:
    """What Moira selects and how its kernels split the work; validated on creation.

    Parameters
    ----------
    gamma:
        Coverage target γ in (0, 1]: each (request, KV head) row keeps the fewest pages whose
        estimated group-mean attention share reaches γ (paper Eq. 3). ``1.0`` keeps every page.
    top_k:
        If set, Select runs in fixed-count mode instead (paper 3.5): every row keeps ``top_k``
        pages, the sink and current page included, and rows of at most ``top_k`` pages are read
        in full. ``gamma`` is then ignored.
    chunk_pages:
        C, the fewest pages one Attend program processes (so a short row needs one program),
        at steps of at least ``floor_rows`` rows.
    floor_rows:
        Rows (requests x KV heads) from which C applies in full. A step with fewer rows (a small
        batch) scales C down in proportion, to no fewer than 2 pages, so that one request's
        few rows still spread over many programs instead of a few long serial chunks.
    schedule:
        How Attend splits the work. ``"rows"``: the paper's Eq. (4), J programs per row, each
        planning its chunk from its row's length. ``"balanced"``: ``programs`` programs split
        the concatenation of all rows' lists evenly (each at least C pages), planning from all
        rows' lengths (``moira/kernels/triton/balanced.py``).
    dense_below_pages:
        Rows of at most this many pages read every page in every mode, and Estimate skips them:
        below some length, estimating and selecting costs more than reading everything
        (0 = off).
    programmatic_launch:
        ``"rows"`` only: launch Estimate, Select, Attend and Merge with programmatic dependent
        launch (sm_90+), so each may be scheduled while the previous one drains
        (``moira/kernels/launch.py``). The Triton kernels chain; the CUDA Attend and Estimate
        launch plainly.
    step_programs:
        T: a row shorter than C * T / rows (rows: the step's requests x KV heads) gets a chunk
        floor of ceil(n * rows / T) pages (at least 2, at most C) instead of C, so that a
        step of a few short rows still spreads over about T programs (about two per H200
        SM at the default) rather than one or two chunks of C pages per row. Steps of T rows
        or more are split as by C alone. 0 turns it off (Eq. 4's floor C alone). 256: no
        shape was more than 0.5% slower than at 128, and 2k x 4 and 8k x 4 were a point or
        more faster (docs/design/work-split.md)
    min_chunks_per_row:
        N_J, the fewest programs Attend launches per row.
    max_chunks_per_row:
        The most programs Attend launches per row (a ceiling on Eq. 4's J, which N_T alone
        makes 512 per row for one request). A row of a small step is then cut into at most
        this many chunks; the programs launched beyond a row's chunks exit at once but are
        not free: in vLLM at batch 1 with 2,048-page tables, J = 342 against 32 made the step
        0.12 ms longer, in Attend and in a GEMM two kernels later (docs/design/work-split.md).
        128 changes only steps of fewer than 32 rows (N_T / 128).
    min_programs:
        N_T, the fewest programs Attend launches in all (so a few long rows still fill the GPU).
    programs:
        P of the balanced schedule: programs launched per step.
    kernels:
        ``KernelOptions``: which kernel runs each stage (Triton or CUDA) and their tuning.
    estimator:
        The page-mass estimate and so the summaries' layout (``summary_rows``): ``"mvar"``
        (the paper's Eq. 2 from the mean and variance, 2 rows), ``"int2"`` or ``"int4"`` (every
        key at 2 / 4 bits per channel, log-sum-exp'd per page: sees a single key whose logit
        towers over its page, which mvar misses; docs/design/estimate.md). The summaries must
        be built for the same estimator (``moira.summarize(..., estimator=...)``).
    bisection_ways:
        The K_B schedule: ``((max_pages, K_B), ...)`` in increasing ``max_pages``; a step whose
        block table holds fewer than ``max_pages`` pages per row uses that K_B, and the last
        entry's K_B applies beyond. Each K_B is a power of two whose log2 divides 24.
    """

    gamma: float = 0.98
    top_k: int | None = None
    chunk_pages: int = 24
    floor_rows: int = 32
    schedule: str = "rows"
    programmatic_launch: bool = False
    dense_below_pages: int = 0
    step_programs: int = 256
    min_chunks_per_row: int = 32
    min_programs: int = 4096
    max_chunks_per_row: int = 128
    programs: int = 1056
    bisection_ways: tuple[tuple[int, int], ...] = ((256, 8), (4096, 4), (32768, 2))
    kernels: KernelOptions = KernelOptions()
    estimator: str = "mvar"

    def __post_init__(self):
        if self.estimator not in ESTIMATOR_BITS:
            raise ValueError(f"estimator must be one of {sorted(ESTIMATOR_BITS)}, got "
                             f"{self.estimator!r}")
        if isinstance(self.kernels, dict):
            object.__setattr__(self, "kernels", KernelOptions.from_mapping(self.kernels))
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"kernels must be a KernelOptions, got {self.kernels!r}: pass "
                             f"KernelOptions(attend='cuda', ...)")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, numbers.Real):
            raise ValueError(f"gamma must be a float in (0, 1], got {self.gamma!r}")
        if not (0.0 < float(self.gamma) <= 1.0):
            raise ValueError(
                f"gamma must lie in (0, 1] (the fraction of attention mass to keep; 1.0 keeps "
                f"every page), got {self.gamma!r}"
            )
        if isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool):
            object.__setattr__(self, "top_k", int(self.top_k))  # e.g. numpy's int64
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 2
        ):
            raise ValueError(
                f"top_k must be None (coverage rule) or an int >= 2 (pages per row, sink and "
                f"current page included), got {self.top_k!r}"
            )
        if self.schedule not in ("rows", "balanced"):
            raise ValueError(f"schedule must be 'rows' (paper Eq. 4) or 'balanced', got "
                             f"{self.schedule!r}")
        if not isinstance(self.programmatic_launch, bool):
            raise ValueError(f"programmatic_launch must be True or False, got "
                             f"{self.programmatic_launch!r}")
        if self.programmatic_launch and self.schedule != "rows":
            raise ValueError("programmatic_launch chains the 'rows' schedule's kernels; use "
                             "schedule='rows' or turn it off")
        if (isinstance(self.step_programs, bool) or not isinstance(self.step_programs, int)
                or self.step_programs < 0):
            raise ValueError(f"step_programs must be an int >= 0 (0 turns it off), got "
                             f"{self.step_programs!r}")
        if isinstance(self.chunk_pages, int) and self.step_programs * self.chunk_pages >= 2**31:
            raise ValueError(f"step_programs * chunk_pages must be below 2**31 (the kernels plan "
                             f"short rows in int32), got {self.step_programs!r} * "
                             f"{self.chunk_pages!r}; lower step_programs")
        if (isinstance(self.dense_below_pages, bool) or not isinstance(self.dense_below_pages, int)
                or self.dense_below_pages < 0):
            raise ValueError(f"dense_below_pages must be an int >= 0 (0 turns it off), got "
                             f"{self.dense_below_pages!r}")
        for name in ("chunk_pages", "floor_rows", "min_chunks_per_row", "min_programs",
                     "max_chunks_per_row", "programs"):
            value = getattr(self, name)
            # the chunks per row are a grid's second dimension (at most 65,535 on CUDA); the
            # others size the workspace's partials and the kernels' int32 plans
            limit = MAX_GRID_Y if name.endswith("_chunks_per_row") else MAX_PROGRAMS
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise ValueError(f"{name} must be an int in [1, {limit}], got {value!r}")
        if self.max_chunks_per_row < self.min_chunks_per_row:
            raise ValueError(f"max_chunks_per_row ({self.max_chunks_per_row}) must be at least "
                             f"min_chunks_per_row ({self.min_chunks_per_row})")
        ways = self.bisection_ways
        if isinstance(ways, (tuple, list)):  # held as tuples (hashable), also from JSON lists
            ways = tuple(tuple(entry) if isinstance(entry, list) else entry for entry in ways)
            object.__setattr__(self, "bisection_ways", ways)
        if (not isinstance(ways, tuple) or not ways
                or any(not isinstance(entry, tuple) or len(entry) != 2 for entry in ways)):
            raise ValueError(
                f"bisection_ways must be a non-empty tuple of (max_pages, K_B) pairs, got {ways!r}"
            )
        bounds = [bound for bound, _ in ways]
        if (any(isinstance(bound, bool) or not isinstance(bound, int) for bound in bounds)
                or bounds != sorted(bounds) or len(set(bounds)) != len(bounds) or bounds[0] < 1):
            raise ValueError(
                f"bisection_ways must list strictly increasing positive int max_pages, got "
                f"{ways!r}"
            )
        for _, k_b in ways:
            if (isinstance(k_b, bool) or not isinstance(k_b, int) or not 2 <= k_b <= MAX_WAYS
                    or k_b & (k_b - 1)):
                raise ValueError(f"bisection_ways: K_B must be a power of two in [2, {MAX_WAYS}] "
                                 f"(a pass holds K_B thresholds x the row's pages on chip), got "
                                 f"{k_b!r}")
            if BISECTION_BITS % int(math.log2(k_b)):
                raise ValueError(
                    f"bisection_ways: log2(K_B) must divide {BISECTION_BITS} so the passes "
                    f"shrink the interval exactly 2**{BISECTION_BITS}-fold, got K_B={k_b}"
                )

    def replace(self, **changes) -> MoiraConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def bisection_ways_for(self, max_pages: int) -> int:
        """K_B for a block table of ``max_pages`` pages per row."""
        for bound, k_b in self.bisection_ways:
            if max_pages < bound:
                return k_b
        return self.bisection_ways[-1][1]

    def chunk_floor(self, num_rows: int) -> int:
        """C of Eq. (4) for a step of ``num_rows`` rows: ``chunk_pages``, scaled down below
        ``floor_rows`` rows (at least 2, never above ``chunk_pages``)."""
        if num_rows >= self.floor_rows:
            return self.chunk_pages
        return min(self.chunk_pages, max(2, self.chunk_pages * num_rows // self.floor_rows))

    def chunks_per_row(self, num_rows: int, max_pages: int | None = None) -> int:
        """J of Eq. (4), at most ``max_chunks_per_row``: programs Attend launches per row for a
        step of ``num_rows`` rows. With ``max_pages`` (the block table's width), J is also
        capped at the most chunks a row of that many pages can have, ceil(max_pages / C):
        the cap only removes programs that would exit at once (a row of n <= max_pages pages
        has c = max(C, ceil(n / J)) and ceil(n / c) <= ceil(max_pages / C) chunks either way),
        or at ceil(T / num_rows) if larger, the chunks a short row has under
        ``step_programs``."""
        rows = max(num_rows, 1)
        chunks = min(max(self.min_chunks_per_row, -(-self.min_programs // rows)),
                     self.max_chunks_per_row)
        if max_pages is not None:
            cap = -(-max_pages // self.chunk_floor(num_rows))
            if self.step_programs:
                cap = max(cap, -(-self.step_programs // rows))
            chunks = min(chunks, max(1, cap))
        return chunks
