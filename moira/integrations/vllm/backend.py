"""The vLLM 0.26 attention backend: FA3's classes with Moira's decode path.

- ``MoiraAttentionBackend``: FA's cache layout (K|V packed in the last dim), 64-token pages,
  bf16/fp16 caches, head dims 64/128, decoder self-attention only.
- ``MoiraMetadataBuilder``: splits each batch into decode rows (first) and the rest. Declares
  ``UNIFORM_SINGLE_TOKEN_DECODE`` CUDA-graph support: pure decode steps replay vLLM's FULL
  graphs with Moira's kernels inside, mixed steps run attention eagerly (vLLM's piecewise
  graphs). Owns the ``DecodeWorkspace`` all its layers share (they run one after another).
- ``MoiraAttentionImpl``: writes K/V itself (``forward_includes_kv_cache_update``): with FA's
  ``do_kv_cache_update`` (vLLM's kernel, on the slots vLLM would pass it) first, or, in pure
  decode steps with ``fused_cache_write``, inside Estimate's launch; in a step with
  non-decode rows ``forward`` runs FA3 as dense vLLM does (over the whole batch, or with
  ``exact_prefill`` off over those rows alone; the decode rows' key lengths zeroed in the
  whole-batch call) and summarizes the pages their slots completed,
  then runs Moira's sparse decode on the decode rows, overwriting FA3's output there (their
  Estimate summarizes the page each row's new token completed: no summarize launch in a pure
  decode step). Its first eager decode forward (vLLM's warm-up before graph capture) also
  builds, without launching, the kernels only mixed steps launch, which vLLM's warm-up never
  runs (``_build_mixed_step_kernels``).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadata,
                                                   FlashAttentionMetadataBuilder)

from ... import reference
from ...config import CACHE_DTYPE_NAMES, MAX_PAGES_PER_SEQ, PAGE_SIZE, SUPPORTED_HEAD_DIMS
from ...decode import DecodeWorkspace, sparse_decode, update_summaries
from ...kernels import launch
from .settings import (SUPPORTED_KV_CACHE_DTYPES, MoiraSettings, cache_write_in_estimate,
                       check_cache_dtype, decode_rows_skipped, explain, fa3_rows,
                       full_read_pages, planning_batch, split_decodes)
from .state import DenseCheck, ImposedFractions, LayerState, PageStatsLog

logger = init_logger("vllm.moira")  # under "vllm", so vLLM's log handler prints it


def _current_config():
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


class MoiraAttentionBackend(FlashAttentionBackend):
    supported_kv_cache_dtypes = ["auto", *CACHE_DTYPE_NAMES]
    # vLLM does not launch its cache write before forward: forward writes K/V (in pure decode
    # steps, with fused_cache_write, inside Estimate's launch: one launch fewer per layer)
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM looks the name up in its backend enum

    @staticmethod
    def get_impl_cls():
        return MoiraAttentionImpl

    @staticmethod
    def get_builder_cls():
        return MoiraMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [PAGE_SIZE]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return PAGE_SIZE

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in SUPPORTED_HEAD_DIMS

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        # pages a KV connector loads (disaggregated prefill, offloaded KV brought back) are
        # written without passing through this backend, so they would have no summaries
        return False

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        return explain(super().validate_configuration(*args, **kwargs))


@dataclasses.dataclass
class MoiraMetadata:
    """Per-step metadata shared by all layers of a KV-cache group.

    Decode rows ``[0, num_decodes)`` are query tokens ``[0, num_decodes)``; ``seq_lens`` and
    ``block_table`` are views of vLLM's persistent tensors for those rows. ``prefill`` is FA3's
    metadata for a step with other rows: for the whole batch from token ``prefill_from`` = 0
    (``exact_prefill``: dense vLLM's FA3 call, the decode rows' key lengths zeroed so that FA3
    skips their pages; Moira then overwrites those rows), or for
    the rows after the decode rows, rebased to start at token ``prefill_from`` =
    ``num_decode_tokens``. ``prefill_slots``: the KV slots the other rows wrote.
    ``dense_below_pages``: decode rows this short read every page (``dense_below_tokens``).
    ``planned_batch``: the decode batch rounded up to a power of two, what Attend plans its
    split for (``planning_batch``: replayed and eager steps alike).
    """

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    workspace: DecodeWorkspace
    prefill: FlashAttentionMetadata | None = None
    prefill_from: int = 0
    prefill_slots: torch.Tensor | None = None
    dense: FlashAttentionMetadata | None = None  # check_dense: FA3 over the whole batch
    keep_fractions: torch.Tensor | None = None  # imposed_fraction: [layers, decodes, heads]
    dense_below_pages: int = 0
    planned_batch: int = 1


def _in_one_split(metadata: FlashAttentionMetadata) -> FlashAttentionMetadata:
    """The same FA3 call in one split. Without an ahead-of-time schedule: FA3 checks its size,
    made for its own split choice."""
    return dataclasses.replace(metadata, max_num_splits=1, scheduler_metadata=None)


def _rows_from(cam: CommonAttentionMetadata, first_row: int,
               first_token: int) -> CommonAttentionMetadata:
    """The batch without its first rows, as FA3 would see it if they were not there."""
    def tail(tensor, start):
        return None if tensor is None else tensor[start:]

    return cam.replace(
        query_start_loc=cam.query_start_loc[first_row:] - first_token,
        query_start_loc_cpu=cam.query_start_loc_cpu[first_row:] - first_token,
        seq_lens=cam.seq_lens[first_row:],
        num_reqs=cam.num_reqs - first_row,
        num_actual_tokens=cam.num_actual_tokens - first_token,
        block_table_tensor=cam.block_table_tensor[first_row:],
        slot_mapping=cam.slot_mapping[first_token:],
        positions=tail(cam.positions, first_token),
        is_prefilling=tail(cam.is_prefilling, first_row),
        seq_lens_cpu_upper_bound=tail(cam.seq_lens_cpu_upper_bound, first_row),
        logits_indices_padded=None, num_logits_indices=None,
        _seq_lens_cpu=None, _num_computed_tokens_cpu=None, _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )


class MoiraMetadataBuilder(FlashAttentionMetadataBuilder):
    # FULL graphs only for steps of single-token decodes: anything else runs attention eagerly
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supports_update_block_table = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # the dense check's extra FA3 call and counters are eager-only (a device-side assert
        # inside FULL graphs on the H200); with it on, attention runs between graph pieces
        if MoiraSettings.from_sources(vllm_config.additional_config, os.environ).check_dense:
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        if not vllm_config.use_v2_model_runner:
            # the V1 path (decode-first order through reorder_batch_threshold) is in place but
            # not yet verified on the GPU; refuse rather than risk silent errors
            raise ValueError(
                "Moira's attention backend is verified with vLLM's V2 model runner (the default "
                "for dense decoder models in vLLM 0.26), and this engine would use V1: unset "
                "VLLM_USE_V2_MODEL_RUNNER (or set it to 1), or drop the feature that needs V1 "
                "(e.g. ngram speculative decoding, custom logits processors)")
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            # each rank would hold a slice of every row's tokens; Moira's pages are whole rows
            raise ValueError("Moira's attention backend does not support decode context "
                             "parallelism yet: drop --decode-context-parallel-size, or use "
                             "another --attention-backend")
        max_model_len = vllm_config.model_config.max_model_len
        if max_model_len > MAX_PAGES_PER_SEQ * PAGE_SIZE:
            raise ValueError(f"Moira's attention backend supports contexts of up to "
                             f"{MAX_PAGES_PER_SEQ * PAGE_SIZE:,} tokens (Select keeps a row of "
                             f"{MAX_PAGES_PER_SEQ} pages on chip), and --max-model-len is "
                             f"{max_model_len:,}: lower --max-model-len")
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decode rows first under the V1 runner too
        self.settings = MoiraSettings.from_sources(vllm_config.additional_config, os.environ)
        logger.info_once(self.settings.describe())
        self.max_batch = max(vllm_config.scheduler_config.max_num_seqs,
                             self.max_cudagraph_size or 0)
        self.workspace = self._workspace(-(-max_model_len // PAGE_SIZE))
        logger.info_once("Moira kernels: " + ", ".join(
            f"{stage}={backend}" for stage, backend in self.workspace.backends.items()))
        self.retired = []
        self.imposed = None
        if self.settings.imposed_fraction is not None:
            self.imposed = ImposedFractions(
                self.settings.imposed_knots,
                vllm_config.model_config.get_total_num_hidden_layers(), self.num_heads_kv,
                self.max_batch, device)
        self.stats_log = PageStatsLog(
            self.settings.stats_interval, log=logger.info,
            note=" (imposed budgets, not the coverage rule)"
            if self.settings.imposed_fraction else "")

    def _workspace(self, max_pages):
        return DecodeWorkspace(self.max_batch, max_pages, self.num_heads_q, self.num_heads_kv,
                               self.headdim, device=self.device, config=self.settings.config)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> MoiraMetadata:
        cam = common_attn_metadata
        self.stats_log.maybe_log()
        width = cam.block_table_tensor.shape[1]
        if width > self.workspace.max_pages_per_seq:  # wider than max_model_len's pages
            # (the first build, before any capture); the old buffers stay alive regardless
            self.retired.append(self.workspace)
            self.workspace = self._workspace(width)
        num_decodes, num_decode_tokens = split_decodes(cam.query_start_loc_cpu, cam.num_reqs,
                                                       cam.max_query_len)
        prefill, prefill_from, prefill_slots, whole_batch = None, 0, None, None
        # with exact_prefill FA3 gets the whole batch, dense vLLM's call (given the batch
        # without its decode rows, it rounded 0.8% of SmolLM2's prefill-row elements apart;
        # docs/design/vllm-integration.md)
        fa3_call = fa3_rows(num_decodes, cam.num_reqs, num_decode_tokens,
                            self.settings.exact_prefill)
        if fa3_call is not None:
            first_row, prefill_from = fa3_call
            prefill = super().build(0, cam if first_row == 0
                                    else _rows_from(cam, first_row, prefill_from), fast_build)
            if first_row == 0:
                whole_batch = prefill
                prefill = decode_rows_skipped(whole_batch, num_decodes)
            prefill_slots = cam.slot_mapping[num_decode_tokens:]
        keep_fractions = None
        if self.imposed is not None and num_decodes:
            keep_fractions = self.imposed.fill(cam.seq_lens[:num_decodes])
        dense = None
        if self.settings.check_dense:
            # dense vLLM's whole-batch call if the engine built it (its decode rows' lengths
            # not zeroed: the other-rows counter checks that zeroing them changes nothing; as
            # a dense engine in this one's graph mode would build it: the check runs without
            # FULL graphs, so FA3's split is not capped as for graph-sized mixed steps);
            # else FA3 over the whole batch without an AOT schedule, whose buffer is the
            # prefill rows'
            dense = (whole_batch if whole_batch is not None
                     else super().build(0, cam, fast_build=True))
        planned = planning_batch(num_decodes)
        return MoiraMetadata(
            num_actual_tokens=cam.num_actual_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, seq_lens=cam.seq_lens[:num_decodes],
            block_table=cam.block_table_tensor[:num_decodes], workspace=self.workspace,
            prefill=prefill, prefill_from=prefill_from, prefill_slots=prefill_slots,
            dense=dense, keep_fractions=keep_fractions,
            dense_below_pages=full_read_pages(self.settings.dense_below_tokens, planned),
            planned_batch=planned)

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class MoiraAttentionImpl(FlashAttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **kwargs):
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "sinks": sinks is not None,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
            f"attn_type={attn_type}": attn_type != AttentionType.DECODER,
            f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES,
            f"head_size={head_size}": head_size not in SUPPORTED_HEAD_DIMS,
        }
        bad = [name for name, is_bad in unsupported.items() if is_bad]
        if bad:
            raise ValueError(f"Moira's attention backend does not support {', '.join(bad)} "
                             "yet; run this model with another --attention-backend")
        if not torch.cuda.is_available():
            raise RuntimeError("Moira's attention backend needs a CUDA GPU")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks, **kwargs)
        config = _current_config()
        if config is not None:
            check_cache_dtype(kv_cache_dtype, config.model_config.dtype)
        self.settings = MoiraSettings.from_sources(config.additional_config if config else None,
                                                   os.environ)
        self.num_layers = config.model_config.get_total_num_hidden_layers() if config else 1
        self.gamma_table = None  # calibrated coverage targets [layers, KV heads], on the GPU
        if self.settings.calibration is not None:
            from ...evaluation import calibration

            if config is None:
                raise RuntimeError("moira calibration: no vLLM config in scope to check the "
                                   "model's layers and KV heads against")
            total_kv_heads = config.model_config.get_total_num_kv_heads()
            if total_kv_heads != self.num_kv_heads:  # this GPU holds a slice of the heads
                raise ValueError("moira calibration with tensor parallelism is not supported "
                                 "yet: run without it, or drop `calibration`")
            ratios = calibration.load(self.settings.calibration, self.num_layers,
                                      total_kv_heads)
            self.gamma_table = calibration.targets(ratios, self.settings.gamma).cuda()
        self.state = None  # LayerState, created when the layer's name is known
        self.layer_index = None
        self.mixed_step_kernels_built = False

    def _state(self, layer) -> LayerState:
        if self.state is None:
            self.state = LayerState(getattr(layer, "layer_name", "?"),
                                    with_stats=self.settings.stats_interval > 0)
        return self.state

    def _layer_index(self, layer) -> int:
        if self.layer_index is None:
            from vllm.model_executor.models.utils import extract_layer_index

            self.layer_index = extract_layer_index(layer.layer_name) % self.num_layers
        return self.layer_index

    def _build_mixed_step_kernels(self, decode, in_estimate, slot_mapping):
        """Build, without launching, the kernels only mixed steps launch: vLLM's warm-up and
        graph capture run pure decode steps alone, so these would otherwise compile at the
        first mixed step of a served request (seconds each): Estimate without the cache write
        (when pure decode steps write in it), and the summaries of the pages prefill rows
        fill, whose slots start at either 16-byte alignment (Triton builds one kernel for
        each)."""
        slots = torch.full((2,), -1, dtype=torch.int64 if slot_mapping is None
                           else slot_mapping.dtype, device=decode["query"].device)
        with launch.build_only():
            if in_estimate:
                sparse_decode(**decode)
            for start in (0, 1):
                update_summaries(decode["key_cache"], slots[start:], decode["summaries"],
                                 estimator=self.settings.estimator)
        self.mixed_step_kernels_built = True

    def _key_value_caches(self, kv_cache):
        # (blocks, Hkv, 64, 2D) logical -> (blocks, 64, Hkv, D) views of K and V
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("Moira does not fuse output quantization")
        from vllm.model_executor.layers.attention.attention import get_attention_context

        # the slots vLLM's own cache-write op would write (it is not launched: see the backend)
        slot_mapping = get_attention_context(layer.layer_name)[3]
        metadata: MoiraMetadata | None = attn_metadata
        in_estimate = (slot_mapping is not None and metadata is not None
                       and cache_write_in_estimate(
                           self.settings.fused_cache_write,
                           fa3_call=metadata.prefill is not None or metadata.dense is not None))
        if slot_mapping is not None and not in_estimate:
            self.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if metadata is None:  # memory profiling run
            return output.fill_(0)
        if metadata.dense is not None:
            dense = torch.empty_like(output)
            super().forward(layer, query, key, value, kv_cache, metadata.dense, dense)
            dense_one_split = torch.empty_like(output)
            super().forward(layer, query, key, value, kv_cache,
                            _in_one_split(metadata.dense),
                            dense_one_split)
        state = self._state(layer)
        summaries = state.summaries_for(kv_cache, self.num_kv_heads, self.head_size,
                                        self.settings.estimator)
        key_cache, value_cache = self._key_value_caches(kv_cache)
        if metadata.prefill is not None:  # FA3 first: Moira then writes the decode rows
            start = metadata.prefill_from
            super().forward(layer, query[start:], None if key is None else key[start:],
                            None if value is None else value[start:], kv_cache,
                            metadata.prefill, output[start:])
            # K/V are in the cache (vLLM writes them before forward): summarize the pages
            # the other rows' slots completed (Estimate does the decode rows')
            update_summaries(key_cache, metadata.prefill_slots, summaries,
                             estimator=self.settings.estimator)
        rows = metadata.num_decodes
        if rows:
            fractions = (None if metadata.keep_fractions is None
                         else metadata.keep_fractions[self._layer_index(layer)])
            gamma = (None if self.gamma_table is None
                     else self.gamma_table[self._layer_index(layer)])  # a view: graph-safe
            decode = dict(query=query[:rows], key_cache=key_cache, value_cache=value_cache,
                          summaries=summaries, block_table=metadata.block_table,
                          seq_lens=metadata.seq_lens, gamma=gamma, scale=self.scale,
                          keep_fractions=fractions,
                          dense_below_pages=metadata.dense_below_pages or None,
                          workspace=metadata.workspace, planned_batch=metadata.planned_batch,
                          out=output[:rows], page_stats=state.page_stats)
            if not self.mixed_step_kernels_built and not torch.cuda.is_current_stream_capturing():
                self._build_mixed_step_kernels(decode, in_estimate, slot_mapping)
            sparse_decode(**decode, **(dict(new_keys=key[:rows], new_values=value[:rows],
                                            slot_mapping=slot_mapping)
                                       if in_estimate else {}))
        if metadata.dense is not None:
            start, end = metadata.num_decode_tokens, metadata.num_actual_tokens
            # the truth both kernels round: float32 attention over every page (the spec)
            exact = reference.dense_attention(query[:rows], key_cache, value_cache,
                                              metadata.block_table, metadata.seq_lens,
                                              scale=self.scale) if rows else None
            DenseCheck.add(state.layer_name, output[:rows], dense[:rows],
                           dense_one_split[:rows], output[start:end], dense[start:end], exact)
        return output
