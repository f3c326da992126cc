"""Plugin settings and the host-side bookkeeping that needs no vLLM (tested on CPU).

Settings come from ``--additional-config '{"moira": {...}}'`` and, for keys it does not set,
from environment variables (handy for ``vllm serve`` scripts; they do not change vLLM's
compile-cache hash, so changing them does not trigger a recompile). An unknown key, or a
``MOIRA_*`` variable that is not one of these, is an error:

=================  =======================  ==================================================
key                environment variable     meaning
=================  =======================  ==================================================
``gamma``          ``MOIRA_GAMMA``          coverage target in (0, 1] (default 0.98); 1.0
                                            keeps every page
``top_k``          ``MOIRA_TOP_K``          fixed-count mode: pages per row instead of the
                                            coverage rule (default: unset)
``stats_interval``  ``MOIRA_STATS_INTERVAL``  seconds between "pages read" log lines; 0 turns
                                            the counters off (default 30)
``check_dense``    ``MOIRA_CHECK_DENSE``    debugging: also run dense FA3 on every batch and
                                            count where Moira differs (slow; default off)
``imposed_fraction``  ``MOIRA_IMPOSED_FRACTION``  timing studies on random weights: instead
                                            of the coverage rule, each (layer, KV head) reads
                                            a fixed fraction of its pages, drawn around this
                                            mean with the paper's spread
                                            (``moira.synthetic.layer_head_fractions``); the
                                            pages are still the top-estimated ones. A number,
                                            or means by context length, interpolated in log
                                            length: ``{"8192": 0.42, "131072": 0.15}``
                                            (environment: ``8192:0.42,131072:0.15``)
``calibration``    ``MOIRA_CALIBRATION``    a ``moira calibrate`` result for this model: each
                                            (layer, KV head) gets its own coverage target
                                            from its measured tail ratio (default: one gamma)
``schedule``       ``MOIRA_SCHEDULE``       how Attend splits its work: ``rows`` (the paper's
                                            per-row chunks, Eq. 4; default) or ``balanced``
                                            (all rows' pages split evenly over a fixed grid)
``programmatic_launch``  ``MOIRA_PROGRAMMATIC_LAUNCH``  launch the decode kernels with
                                            programmatic dependent launch (``rows`` only;
                                            default off; ``moira/kernels/launch.py``)
``exact_prefill``  ``MOIRA_EXACT_PREFILL``  mixed steps (decode and prefill rows): FA3
                                            runs over the whole batch, as in dense vLLM, so
                                            the prefill rows are dense vLLM's bit for bit
                                            (FA3 picks its split from the batch it is
                                            given; the decode rows' key lengths zeroed,
                                            ``decode_rows_skipped``); Moira then writes
                                            the decode rows (default on; off: FA3 over the
                                            prefill rows alone; on the H200 a dense
                                            engine's prefill log-probs matched bit for
                                            bit with it on, 12 of 12 prompts; with the
                                            zeroing, 0 of 468,926,464 other-row elements
                                            differed from dense vLLM's call;
                                            docs/design/vllm-integration.md)
``dense_below_tokens``  ``MOIRA_DENSE_BELOW_TOKENS``  a decode step of B requests reads
                                            every page of its rows of at most this / B
                                            tokens, skipping Estimate's and Select's work:
                                            small batches of short contexts, where selecting
                                            costs more than it saves (default 20480, where
                                            the two cost the same per layer on the H200 at
                                            batch 1; 0 = off)
``floor_rows``     ``MOIRA_FLOOR_ROWS``     Attend's split (``MoiraConfig``): steps of fewer
                                            rows (requests x KV heads) scale the chunk floor
                                            of 24 pages down in proportion (default 32)
``min_programs``   ``MOIRA_MIN_PROGRAMS``   Attend's split: the fewest programs per step,
                                            so a few rows still fill the GPU (default 4096;
                                            with 1, 32 chunks per row;
                                            docs/design/work-split.md)
``step_programs``  ``MOIRA_STEP_PROGRAMS``  Attend's split: a short row of a small step is
                                            cut finer so the step has about this many
                                            programs (default 256; 0: Eq. 4's floor C alone)
``min_chunks_per_row``  ``MOIRA_MIN_CHUNKS_PER_ROW``  Attend's split: the fewest programs
                                            per row, N_J (default 32)
``max_chunks_per_row``  ``MOIRA_MAX_CHUNKS_PER_ROW``  Attend's split: the most programs
                                            per row (default 128; binds only in steps of
                                            fewer than min_programs / 128 rows; 4096: J
                                            from Eq. 4 alone; docs/design/work-split.md)
``fused_cache_write``  ``MOIRA_FUSED_CACHE_WRITE``  pure decode steps write each new
                                            token's K and V inside Estimate's launch instead
                                            of vLLM's ``reshape_and_cache_flash`` kernel
                                            (one launch fewer per layer; mixed steps write
                                            them with vLLM's kernel; default on: outputs
                                            bit-identical in vLLM, 0.06 ms less per token at
                                            8k x 1 on the H200; docs/design/summaries.md)
``estimator``      ``MOIRA_ESTIMATOR``      the page-mass estimate (``MoiraConfig.estimator``):
                                            ``mvar`` (the paper's, default), ``int2`` or
                                            ``int4`` (every key at 2 / 4 bits: sees short
                                            needles mvar misses; its summaries take 7.8% /
                                            14% of the K+V cache at head dim 128 against
                                            mvar's 1.6%: ``summary_bytes``)
``kernels``        ``MOIRA_KERNELS``        which kernel runs each stage and their tuning
                                            (``moira.KernelOptions``): a JSON object such as
                                            ``{"attend": "cuda", "fused": "off", "tuning":
                                            {"attend.cuda_stages": 3}}``, or in the
                                            environment ``attend=cuda,fused=off,``
                                            ``attend.cuda_stages=3`` (default: every stage
                                            "auto" but Select, "triton"; the startup log
                                            names what each stage resolved to)
=================  =======================  ==================================================
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ...config import (
    CACHE_DTYPE_NAMES,
    PAGE_SIZE,
    SUPPORTED_HEAD_DIMS,
    KernelOptions,
    MoiraConfig,
    summary_rows,
)

# settings passed through to MoiraConfig's fields of the same name (None: its default)
SPLIT_SETTINGS = ("floor_rows", "min_programs", "step_programs", "min_chunks_per_row",
                  "max_chunks_per_row")

BOOL_SETTINGS = ("check_dense", "programmatic_launch", "exact_prefill", "fused_cache_write")

SUPPORTED_KV_CACHE_DTYPES = (None, "auto", *CACHE_DTYPE_NAMES)


@dataclasses.dataclass(frozen=True)
class MoiraSettings:
    gamma: float = 0.98
    top_k: int | None = None
    stats_interval: float = 30.0
    check_dense: bool = False
    imposed_fraction: float | dict | None = None
    schedule: str = "rows"
    programmatic_launch: bool = False
    exact_prefill: bool = True
    dense_below_tokens: int = 20480
    calibration: str | None = None
    floor_rows: int | None = None  # None: MoiraConfig's
    min_programs: int | None = None
    step_programs: int | None = None
    min_chunks_per_row: int | None = None
    max_chunks_per_row: int | None = None
    fused_cache_write: bool = True
    kernels: KernelOptions = KernelOptions()
    estimator: str = "mvar"

    _ENV = {"gamma": "MOIRA_GAMMA", "top_k": "MOIRA_TOP_K",
            "stats_interval": "MOIRA_STATS_INTERVAL", "check_dense": "MOIRA_CHECK_DENSE",
            "imposed_fraction": "MOIRA_IMPOSED_FRACTION", "schedule": "MOIRA_SCHEDULE",
            "programmatic_launch": "MOIRA_PROGRAMMATIC_LAUNCH",
            "exact_prefill": "MOIRA_EXACT_PREFILL",
            "dense_below_tokens": "MOIRA_DENSE_BELOW_TOKENS",
            "calibration": "MOIRA_CALIBRATION", "floor_rows": "MOIRA_FLOOR_ROWS",
            "min_programs": "MOIRA_MIN_PROGRAMS", "step_programs": "MOIRA_STEP_PROGRAMS",
            "min_chunks_per_row": "MOIRA_MIN_CHUNKS_PER_ROW",
            "max_chunks_per_row": "MOIRA_MAX_CHUNKS_PER_ROW",
            "fused_cache_write": "MOIRA_FUSED_CACHE_WRITE", "kernels": "MOIRA_KERNELS",
            "estimator": "MOIRA_ESTIMATOR"}

    def __post_init__(self):
        if not isinstance(self.kernels, KernelOptions):  # a JSON object's errors name the key
            try:
                object.__setattr__(self, "kernels", KernelOptions.from_mapping(self.kernels))
            except (TypeError, ValueError) as error:
                raise ValueError(f"moira kernels: {error}") from None
        tokens = self.dense_below_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"moira dense_below_tokens must be an int >= 0 (0 turns it off), "
                             f"got {self.dense_below_tokens!r}")
        self.config  # MoiraConfig's errors name the field and its range
        if not (isinstance(self.stats_interval, (int, float))
                and not isinstance(self.stats_interval, bool) and self.stats_interval >= 0
                and math.isfinite(self.stats_interval)):
            raise ValueError(f"moira stats_interval must be a number of seconds >= 0 (0 turns "
                             f"the page counters off), got {self.stats_interval!r}")
        if self.imposed_fraction is not None:
            self.imposed_knots  # its errors name the knot and the fix
            if self.top_k is not None:
                raise ValueError("moira: set top_k or imposed_fraction, not both")
        if self.calibration is not None:
            if not isinstance(self.calibration, str):
                raise ValueError(f"moira calibration must be the path of a `moira calibrate` "
                                 f"result, got {self.calibration!r}")
            if self.top_k is not None or self.imposed_fraction is not None:
                raise ValueError("moira calibration sets per-head coverage targets; it does "
                                 "not combine with top_k or imposed_fraction")
            if self.estimator != "mvar":
                raise ValueError(f"moira calibration's per-head targets are measured with the "
                                 f"mvar estimate; with estimator={self.estimator!r} use one "
                                 f"gamma (unset calibration)")
        for name in BOOL_SETTINGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"moira {name} must be true or false, got "
                                 f"{getattr(self, name)!r}")

    def describe(self) -> str:
        """One line for the startup log: the settings that differ from the defaults."""
        changed = [f"{field.name}={getattr(self, field.name)!r}"
                   for field in dataclasses.fields(self)
                   if field.name != "gamma" and getattr(self, field.name) != field.default]
        return (f"Moira attention: gamma={self.gamma!r}" + "".join(", " + c for c in changed)
                + ("" if changed else ", other settings default")
                + " (moira/integrations/vllm/settings.py)")

    @property
    def imposed_knots(self) -> tuple[tuple[int, float], ...]:
        """``imposed_fraction`` as ``((context_tokens, mean_fraction), ...)``, sorted."""
        given = self.imposed_fraction
        pairs = given.items() if isinstance(given, dict) else [(1, given)]
        if not pairs:
            raise ValueError("moira imposed_fraction: a mapping needs at least one context "
                             "length, e.g. {\"8192\": 0.42}; or give one fraction for all")
        knots = []
        for tokens, fraction in pairs:
            try:
                tokens = int(tokens)
            except (TypeError, ValueError):
                tokens = -1
            if (tokens < 1 or isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                    or not 0 < fraction <= 1):
                raise ValueError(
                    f"moira imposed_fraction must be a fraction in (0, 1] or a mapping from "
                    f"context length (tokens >= 1) to such fractions, got {given!r}")
            knots.append((tokens, float(fraction)))
        return tuple(sorted(knots))

    @property
    def config(self) -> MoiraConfig:
        split = {name: getattr(self, name) for name in SPLIT_SETTINGS
                 if getattr(self, name) is not None}
        return MoiraConfig(gamma=self.gamma, top_k=self.top_k, schedule=self.schedule,
                           programmatic_launch=self.programmatic_launch, kernels=self.kernels,
                           estimator=self.estimator, **split)

    @classmethod
    def from_sources(cls, additional_config: Mapping | None,
                     environ: Mapping[str, str]) -> MoiraSettings:
        """``additional_config["moira"]`` first, then ``MOIRA_*`` variables, then defaults."""
        given = (additional_config or {}).get("moira")
        given = {} if given is None else given  # only null means unset: [] or 0 is a mistake
        if not isinstance(given, Mapping):
            raise ValueError(f"additional_config['moira'] must be a JSON object of settings, "
                             f'e.g. {{"moira": {{"gamma": 0.98}}}}, got {given!r}')
        given = dict(given)
        unknown = sorted(set(given) - set(cls._ENV))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in additional_config['moira']; known: "
                             f"{sorted(cls._ENV)}")
        stale = sorted(name for name, text in environ.items() if name.startswith("MOIRA_")
                       and text != "" and name not in cls._ENV.values())
        if stale:  # e.g. a setting since removed: better refused than silently ignored
            raise ValueError(f"unknown environment variable(s) {stale}; Moira's are "
                             f"{sorted(cls._ENV.values())}: unset the others")
        values = {}
        for key, variable in cls._ENV.items():
            if key in given:
                values[key] = given[key]
            elif environ.get(variable, "") != "":
                text = environ[variable]
                if key in BOOL_SETTINGS:
                    if text not in ("0", "1"):
                        raise ValueError(f"{variable}={text!r}: use 0 or 1")
                    values[key] = text == "1"
                    continue
                if key in ("schedule", "calibration", "estimator"):
                    values[key] = text
                    continue
                if key == "kernels":
                    try:
                        values[key] = KernelOptions.parse(text)
                    except ValueError as error:
                        raise ValueError(f"{variable}={text!r}: {error}") from None
                    continue
                if key == "imposed_fraction" and ":" in text:
                    try:
                        values[key] = {int(t): float(f) for t, f in
                                       (pair.split(":") for pair in text.split(","))}
                    except ValueError:
                        raise ValueError(f"{variable}={text!r}: use a fraction or "
                                         f"tokens:fraction,tokens:fraction") from None
                    continue
                whole = key in ("top_k", "dense_below_tokens", *SPLIT_SETTINGS)
                try:
                    values[key] = int(text) if whole else float(text)
                except ValueError:
                    raise ValueError(f"{variable}={text!r} is not "
                                     f"{'a whole number' if whole else 'a number'}") from None
        if isinstance(values.get("gamma"), int) and not isinstance(values["gamma"], bool):
            values["gamma"] = float(values["gamma"])  # JSON's 1 means 1.0
        return cls(**values)


# Why vLLM rejected the backend, in words that say what to change.
_FIXES = {
    "block_size not supported": (
        "Moira reads 64-token pages: start vLLM with --block-size 64"),
    "kv_cache_dtype not supported": (
        "Moira reads bf16 or fp16 KV caches only (no FP8 or other quantized cache yet): use "
        "--kv-cache-dtype auto"),
    "dtype not supported": (
        "Moira's kernels read bf16 or fp16 queries and caches: start vLLM with --dtype bfloat16 "
        "(or float16)"),
    "head_size not supported": (
        f"Moira has kernels for head dims {SUPPORTED_HEAD_DIMS} only; use another attention "
        "backend for this model"),
    "sliding window not supported": (
        "Moira does not support sliding-window layers; use another attention backend for "
        "this model"),
    "attention sinks not supported": (
        "Moira does not support attention sinks; use another attention backend"),
    "KV connector not supported": (
        "Moira summarizes the pages it writes, and a KV connector (--kv-transfer-config: "
        "disaggregated prefill, KV offloading) writes pages past it: drop the connector or use "
        "another attention backend"),
}


def check_cache_dtype(kv_cache_dtype, model_dtype) -> None:
    """A ValueError if ``--kv-cache-dtype`` names a dtype other than the model's (a
    ``torch.dtype``): the kernels read the query and the cache in one dtype, and would
    otherwise refuse the first decode step with no word of the flag."""
    model = str(model_dtype).removeprefix("torch.")
    if kv_cache_dtype not in (None, "auto") and kv_cache_dtype != model:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} differs from the model's dtype "
                         f"{model}: Moira reads the query and the KV cache in one dtype; use "
                         f"--kv-cache-dtype auto")


def explain(reasons: list[str]) -> list[str]:
    """vLLM's terse rejection reasons, each with the fix appended where one is known."""
    explained = []
    for reason in reasons:
        fix = _FIXES.get(reason)
        if fix is None and reason.startswith("attention type"):
            fix = ("Moira handles decoder self-attention only (no encoder or encoder-decoder "
                   "attention)")
        explained.append(f"{reason} ({fix})" if fix else reason)
    return explained


def split_decodes(query_start_loc_cpu, num_reqs: int, max_query_len: int) -> tuple[int, int]:
    """``(num_decodes, num_decode_tokens)``: the leading rows with exactly one query token.

    vLLM orders a batch decode-first (the V2 runner always; the V1 runner because the builder
    sets ``reorder_batch_threshold = 1``). In a pure-decode step (``max_query_len <= 1``) every
    row is a decode row, including graph padding rows (no token, ``seq_len`` 0: output zeros).
    Otherwise decode row ``i`` must be query token ``i``, so the decode rows end at the first
    row that does not hold exactly one token; every later row goes to FA3 (exact, dense), so a
    mis-ordered batch stays correct and only loses sparsity.
    """
    if max_query_len <= 1:
        return num_reqs, int(query_start_loc_cpu[num_reqs])
    starts = query_start_loc_cpu[: num_reqs + 1]
    lengths = (starts[1:] - starts[:-1]).tolist()
    num_decodes = 0
    while num_decodes < num_reqs and lengths[num_decodes] == 1:
        num_decodes += 1
    return num_decodes, num_decodes


def fa3_rows(num_decodes: int, num_reqs: int, num_decode_tokens: int,
             exact_prefill: bool) -> tuple[int, int] | None:
    """``(first_row, first_token)`` of the rows FA3 computes in a step, or ``None`` in a pure
    decode step (Moira alone). FA3 picks its split per launch from the batch it is given, so
    with ``exact_prefill`` a mixed step hands it the whole batch, as dense vLLM does (Moira then
    overwrites the decode rows); without, the rows after the decode rows."""
    if num_decodes == num_reqs:
        return None
    if exact_prefill or num_decodes == 0:
        return 0, 0
    return num_decodes, num_decode_tokens


def cache_write_in_estimate(fused_cache_write: bool, fa3_call: bool) -> bool:
    """Whether a step's new K/V go into the cache inside Estimate's launch: with
    ``fused_cache_write``, in steps where no FA3 call (prefill rows, the dense check) reads the
    cache before Moira's kernels; other steps write them first with vLLM's own kernel."""
    return fused_cache_write and not fa3_call


def summary_bytes(num_blocks: int, num_kv_heads: int, head_dim: int, element_size: int,
                  estimator: str = "mvar") -> int:
    """Bytes of one layer's page summaries (``config.summary_rows`` rows of ``head_dim`` per
    page and KV head): mvar 2 / 64 of the K cache (1/64 of the K+V cache); int2 and int4 add
    the keys' codes, 2 / 16 and 4 / 16 of the K cache."""
    rows = summary_rows(estimator, element_size)
    return num_blocks * num_kv_heads * rows * head_dim * element_size


def planning_batch(num_decodes: int) -> int:
    """The batch size a decode step of ``num_decodes`` requests plans Attend's split (and the
    full-read threshold) for: the next power of two. A FULL-graph step is padded to the
    smallest capture size >= its batch; vLLM's default capture sizes (1, 2, 4, then multiples
    of 8) hold every power of two up to the largest, so no power of two lies between a batch
    and its padded size: the replayed graph and an eager step of the same requests plan
    alike and compute bit-identical outputs (with capture sizes that skip a power of two,
    they can differ in rounding)."""
    return 1 << max(num_decodes - 1, 0).bit_length()


def full_read_pages(dense_below_tokens: int, num_decodes: int) -> int:
    """``MoiraConfig.dense_below_pages`` for a decode step of ``num_decodes`` requests: rows of
    at most ``dense_below_tokens / num_decodes`` tokens read every page (so the threshold is
    on the step's work, and a full batch of short requests keeps selecting). A host value from
    the batch size alone: vLLM captures one graph per padded batch size, and each replay of it
    gets the value it was captured with."""
    return dense_below_tokens // PAGE_SIZE // max(num_decodes, 1)


def decode_rows_skipped(whole_batch, num_decodes: int):
    """``whole_batch``, vLLM's ``FlashAttentionMetadata`` (a dataclass) for FA3's call over the
    whole batch, with the decode rows' key lengths zeroed, so FA3 reads none of their pages
    (Moira overwrites those rows: FA3 writes 0 there). Each row's split count comes
    from the ahead-of-time schedule, computed from the full lengths, and a row's key range from
    its own length only (FA3 hopper: ``seqlen.h``, ``block.h``, ``tile_scheduler.hpp``), so the
    other rows are computed as in the full call. Without a schedule FA3 would plan from the
    zeroed lengths: the full call then. Mixed steps run eagerly, so the copy may be new."""
    if whole_batch.scheduler_metadata is None or num_decodes == 0:
        return whole_batch
    seq_lens = whole_batch.seq_lens.clone()  # a view of vLLM's persistent lengths otherwise
    seq_lens[:num_decodes] = 0
    return dataclasses.replace(whole_batch, seq_lens=seq_lens)
