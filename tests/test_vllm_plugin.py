"""The vLLM plugin's host-side logic (no vLLM needed): settings, batch splitting, per-layer
state. The engine-level checks run on the GPU host: benchmarks/vllm_checks.py."""

import pytest
import torch
from helpers import DEVICE, make_cache

import moira
from moira.integrations.vllm.settings import (MoiraSettings, cache_write_in_estimate,
                                              check_cache_dtype, decode_rows_skipped, explain,
                                              fa3_rows, full_read_pages, planning_batch,
                                              split_decodes, summary_bytes)
from moira.integrations.vllm.state import (DenseCheck, ImposedFractions, LayerState,
                                           PageStatsLog, bf16_ulps)


def test_settings_come_from_additional_config_then_environment():
    assert MoiraSettings.from_sources(None, {}) == MoiraSettings()
    settings = MoiraSettings.from_sources(
        {"moira": {"gamma": 1}}, {"MOIRA_GAMMA": "0.5", "MOIRA_TOP_K": "16",
                                  "MOIRA_STATS_INTERVAL": "0", "MOIRA_CHECK_DENSE": "1"})
    assert settings == MoiraSettings(gamma=1.0, top_k=16, stats_interval=0.0, check_dense=True)
    assert settings.config.gamma == 1.0 and settings.config.top_k == 16
    balanced = MoiraSettings.from_sources(None, {"MOIRA_SCHEDULE": "balanced"})
    assert balanced.config.schedule == "balanced"
    assert MoiraSettings().dense_below_tokens == 20480  # chosen at batch 1 on the H200
    short = MoiraSettings.from_sources(None, {"MOIRA_DENSE_BELOW_TOKENS": "4096"})
    assert short.dense_below_tokens == 4096
    assert short.config.dense_below_pages == 0  # set per step: full_read_pages
    assert MoiraSettings().exact_prefill  # prefill rows as dense vLLM's unless turned off
    assert not MoiraSettings.from_sources(None, {"MOIRA_EXACT_PREFILL": "0"}).exact_prefill
    assert not MoiraSettings.from_sources({"moira": {"exact_prefill": False}}, {}).exact_prefill
    with pytest.raises(ValueError, match="exact_prefill must be true or false"):
        MoiraSettings.from_sources({"moira": {"exact_prefill": "yes"}}, {})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['prefill_one_split'\]"):
        MoiraSettings.from_sources({"moira": {"prefill_one_split": True}}, {})  # removed
    assert MoiraSettings.from_sources(None, {"MOIRA_FUSED_MERGE": ""}) == MoiraSettings()  # unset
    chained = MoiraSettings.from_sources({"moira": {"programmatic_launch": True}}, {})
    assert chained.config.programmatic_launch
    assert MoiraSettings.from_sources(None, {"MOIRA_PROGRAMMATIC_LAUNCH": "1"}
                                      ).config.programmatic_launch
    split = MoiraSettings.from_sources({"moira": {"floor_rows": 96}}, {"MOIRA_MIN_PROGRAMS": "1"})
    assert (split.config.floor_rows, split.config.min_programs) == (96, 1)
    assert split.config.chunk_floor(8) == 2 and split.config.chunks_per_row(8) == 32
    eq4 = MoiraSettings.from_sources(None, {"MOIRA_STEP_PROGRAMS": "0"})
    assert eq4.config.step_programs == 0
    assert MoiraSettings.from_sources({"moira": {"step_programs": 256}}, {}
                                      ).config.step_programs == 256
    uncapped = MoiraSettings.from_sources(None, {"MOIRA_MAX_CHUNKS_PER_ROW": "4096"})
    assert uncapped.config.chunks_per_row(8, 2048) == 342  # J from Eq. (4) alone (default 128)
    with pytest.raises(ValueError, match="max_chunks_per_row"):
        MoiraSettings.from_sources({"moira": {"max_chunks_per_row": 16}}, {})  # below N_J
    fewer = MoiraSettings.from_sources(None, {"MOIRA_MIN_CHUNKS_PER_ROW": "16"})
    assert fewer.config.chunks_per_row(256, 2037) == 16  # 8k x 32: N_J 16, not 32
    assert MoiraSettings().config == moira.MoiraConfig()  # unset: MoiraConfig's defaults
    assert MoiraSettings.from_sources(None, {"MOIRA_ESTIMATOR": "int2"}).config.estimator \
        == "int2"
    assert MoiraSettings.from_sources({"moira": {"estimator": "int4"}}, {}).config.estimator \
        == "int4"
    with pytest.raises(ValueError, match="estimator must be one of"):
        MoiraSettings.from_sources({"moira": {"estimator": "quest"}}, {})
    with pytest.raises(ValueError, match="measured with the mvar estimate"):
        MoiraSettings.from_sources({"moira": {"estimator": "int2", "calibration": "c.json"}}, {})
    assert MoiraSettings().describe().startswith(
        "Moira attention: gamma=0.98, other settings default (")
    assert split.describe().startswith("Moira attention: gamma=0.98, floor_rows=96, "
                                       "min_programs=1 (")
    assert MoiraSettings(gamma=1.0).describe().count("gamma") == 1
    calibrated = MoiraSettings.from_sources({"moira": {"calibration": "cal.json"}}, {})
    assert calibrated.calibration == "cal.json"
    assert MoiraSettings().fused_cache_write  # bit-identical outputs, one launch fewer
    assert not MoiraSettings.from_sources(None, {"MOIRA_FUSED_CACHE_WRITE": "0"}
                                          ).fused_cache_write
    assert not MoiraSettings.from_sources({"moira": {"fused_cache_write": False}}, {}
                                          ).fused_cache_write


def test_the_cache_write_joins_estimate_only_in_steps_without_an_fa3_call():
    assert cache_write_in_estimate(True, fa3_call=False)
    assert not cache_write_in_estimate(True, fa3_call=True)  # FA3 reads the cache first
    assert not cache_write_in_estimate(False, fa3_call=False)


@pytest.mark.parametrize("config, environ, match", [
    ({"moira": {"gamma": 1.5}}, {}, "gamma must lie in"),
    ({"moira": {"gamma": 0}}, {}, "gamma must lie in"),
    (None, {"MOIRA_GAMMA": "high"}, "MOIRA_GAMMA='high' is not a number"),
    (None, {"MOIRA_TOP_K": "8.0"}, "MOIRA_TOP_K='8.0' is not a whole number"),
    ({"moira": {"top_k": 1}}, {}, "top_k must be None"),
    ({"moira": {"gama": 0.9}}, {}, r"unknown key\(s\) \['gama'\]"),
    ({"moira": {"stats_interval": -1}}, {}, "stats_interval must be"),
    ({"moira": {"stats_interval": True}}, {}, "stats_interval must be"),
    ({"moira": "gamma=0.9"}, {}, "must be a JSON object"),
    ({"moira": []}, {}, "must be a JSON object"),  # only null means unset
    ({"moira": {"imposed_fraction": {}}}, {}, "needs at least one context length"),
    ({"moira": {"min_programs": 10**12}}, {}, "min_programs must be an int in"),
    ({"moira": {"imposed_fraction": 1.5}}, {}, "imposed_fraction must be a fraction"),
    (None, {"MOIRA_IMPOSED_FRACTION": "8k:0.4"}, "use a fraction or tokens:fraction"),
    ({"moira": {"imposed_fraction": 0.3, "top_k": 8}}, {}, "top_k or imposed_fraction"),
    (None, {"MOIRA_CHECK_DENSE": "yes"}, "use 0 or 1"),
    ({"moira": {"schedule": "even"}}, {}, "schedule must be 'rows'"),
    ({"moira": {"calibration": 3}}, {}, "calibration must be the path"),
    # options measured slower on the H200 and removed (docs/design/): unknown keys like any other
    ({"moira": {"fused_merge": True}}, {}, r"unknown key\(s\) \['fused_merge'\]"),
    ({"moira": {"fused_select": True}}, {}, r"unknown key\(s\) \['fused_select'\]"),
    (None, {"MOIRA_FUSED_MERGE": "1"},
     r"unknown environment variable\(s\) \['MOIRA_FUSED_MERGE'\]"),
    ({"moira": {"dense_below_tokens": -64}}, {}, "dense_below_tokens must be an int >= 0"),
    ({"moira": {"dense_below_tokens": 1.5}}, {}, "dense_below_tokens must be an int >= 0"),
    ({"moira": {"programmatic_launch": 1}}, {}, "programmatic_launch must be True or False"),
    (None, {"MOIRA_PROGRAMMATIC_LAUNCH": "on"}, "use 0 or 1"),
    ({"moira": {"programmatic_launch": True, "schedule": "balanced"}}, {},
     "programmatic_launch chains"),
    ({"moira": {"calibration": "c.json", "top_k": 8}}, {}, "does not combine with top_k"),
    ({"moira": {"floor_rows": 0}}, {}, "floor_rows must be an int in"),
    (None, {"MOIRA_MIN_PROGRAMS": "many"}, "MOIRA_MIN_PROGRAMS='many' is not a whole number"),
    (None, {"MOIRA_FUSED_CACHE_WRITE": "yes"}, "use 0 or 1"),
    ({"moira": {"fused_cache_write": 1}}, {}, "fused_cache_write must be true or false"),
])
def test_bad_settings_name_the_setting(config, environ, match):
    with pytest.raises(ValueError, match=match):
        MoiraSettings.from_sources(config, environ)


def test_fa3s_whole_batch_call_skips_the_decode_rows_only_with_its_own_schedule():
    import dataclasses

    @dataclasses.dataclass
    class Fa3Metadata:  # the fields of vLLM's FlashAttentionMetadata the function touches
        seq_lens: torch.Tensor
        scheduler_metadata: torch.Tensor | None
        max_seq_len: int = 900

    persistent = torch.tensor([700, 900, 40, 300], dtype=torch.int32)
    scheduled = Fa3Metadata(persistent[:3], torch.arange(8, dtype=torch.int32))
    skipped = decode_rows_skipped(scheduled, num_decodes=2)
    assert skipped.seq_lens.tolist() == [0, 0, 40] and skipped.seq_lens.dtype == torch.int32
    assert skipped.scheduler_metadata is scheduled.scheduler_metadata  # planned from the full
    assert skipped.max_seq_len == 900  # FA3's host-side split choice and tile sizes unchanged
    assert persistent.tolist() == [700, 900, 40, 300]  # vLLM's tensor untouched
    assert decode_rows_skipped(scheduled, num_decodes=0) is scheduled
    unscheduled = Fa3Metadata(persistent[:3], None)  # FA3 would plan from the zeroed lengths
    assert decode_rows_skipped(unscheduled, num_decodes=2) is unscheduled


def test_imposed_fractions_have_the_papers_spread():
    from moira.synthetic import layer_head_fractions

    table = layer_head_fractions(0.31, 32, 8)
    assert table.shape == (32, 8) and table.dtype == torch.float32
    assert abs(table.mean().item() - 0.31) < 1e-3
    layer_means = table.mean(1)
    assert layer_means[0] == layer_means.max()  # the first layer reads the most
    assert layer_means.max() / layer_means.min() > 4
    cv = table.std(1, unbiased=False) / table.mean(1)
    assert 0.5 < cv[1:].median() < 0.8 and (table > 0).all() and (table <= 1).all()
    assert torch.equal(table, layer_head_fractions(0.31, 32, 8))  # deterministic
    settings = MoiraSettings.from_sources(None, {"MOIRA_IMPOSED_FRACTION": "0.15"})
    assert settings.imposed_knots == ((1, 0.15),)


def test_imposed_fractions_follow_the_context_length():
    settings = MoiraSettings.from_sources(
        None, {"MOIRA_IMPOSED_FRACTION": "131072:0.15,8192:0.42"})
    assert settings.imposed_knots == ((8192, 0.42), (131072, 0.15))
    imposed = ImposedFractions(settings.imposed_knots, num_layers=4, num_kv_heads=8,
                               max_batch=6, device=DEVICE)
    seq_lens = torch.tensor([4096, 8192, 32768, 131072, 500000], dtype=torch.int32,
                            device=DEVICE)
    fractions = imposed.fill(seq_lens)
    assert fractions.shape == (4, 5, 8)
    means = fractions.mean(dim=(0, 2))
    assert abs(means[1] - 0.42) < 1e-3 and abs(means[3] - 0.15) < 1e-3
    # clamped outside the knots (at a knot, alpha may round to ~1e-7 instead of 0)
    torch.testing.assert_close(means[0], means[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(means[4], means[3], rtol=0, atol=1e-6)
    assert 0.15 < means[2] < 0.42  # halfway in log length
    assert fractions.data_ptr() == imposed.buffer.data_ptr()  # a view of the persistent buffer


def test_a_cache_dtype_other_than_the_models_names_the_flag():
    check_cache_dtype("auto", torch.float16)
    check_cache_dtype(None, torch.bfloat16)
    check_cache_dtype("bfloat16", torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 differs from the model's "
                                         "dtype float16"):
        check_cache_dtype("bfloat16", torch.float16)


def test_rejections_say_what_to_change():
    reasons = explain(["block_size not supported", "kv_cache_dtype not supported",
                       "attention type encoder not supported", "compute capability not supported",
                       "KV connector not supported"])
    assert "--block-size 64" in reasons[0]
    assert "FP8" in reasons[1] and "--kv-cache-dtype auto" in reasons[1]
    assert "--dtype bfloat16" in explain(["dtype not supported"])[0]
    assert "decoder self-attention only" in reasons[2]
    assert reasons[3] == "compute capability not supported"
    assert "drop the connector" in reasons[4]


@pytest.mark.parametrize("query_lens, max_query_len, expected", [
    ([1, 1, 1], 1, (3, 3)),          # pure decode
    ([1, 1, 0, 0], 1, (4, 2)),       # pure decode with graph padding rows
    ([1, 1, 37, 500], 500, (2, 2)),  # mixed: decode rows first
    ([64, 1, 1], 64, (0, 0)),        # mis-ordered: FA3 takes every row (exact, not sparse)
    ([1, 5, 1], 5, (1, 1)),
])
def test_split_decodes(query_lens, max_query_len, expected):
    starts = torch.tensor([0] + query_lens).cumsum(0).int()
    assert split_decodes(starts, len(query_lens), max_query_len) == expected


@pytest.mark.parametrize("num_decodes, num_reqs, decode_tokens, exact, expected", [
    (4, 4, 4, True, None),  # pure decode: Moira alone
    (4, 4, 4, False, None),
    (0, 3, 0, True, (0, 0)),  # pure prefill: FA3's whole batch either way
    (0, 3, 0, False, (0, 0)),
    (2, 5, 2, True, (0, 0)),  # mixed: the whole batch, as dense vLLM hands it to FA3
    (2, 5, 2, False, (2, 2)),  # or the rows after the decode rows
])
def test_fa3_gets_the_whole_batch_in_mixed_steps(num_decodes, num_reqs, decode_tokens, exact,
                                                 expected):
    assert fa3_rows(num_decodes, num_reqs, decode_tokens, exact) == expected


def test_summary_size_against_the_kv_cache():
    kv_bytes = 1000 * 8 * 64 * 2 * 128 * 2  # blocks, heads, tokens, K and V, dims, bf16
    assert summary_bytes(1000, 8, 128, 2) * 64 == kv_bytes  # mvar: a 64th
    # int2: min and max (a 64th of K+V) + 2 bits of every key (an 8th of K, 1/16 of K+V)
    assert summary_bytes(1000, 8, 128, 2, "int2") * 64 == kv_bytes * 5
    assert summary_bytes(1000, 8, 128, 2, "int4") * 64 == kv_bytes * 9


def test_layer_state_keeps_summaries_for_its_cache_and_renews_them_for_a_new_one():
    state = LayerState("model.layers.0.self_attn.attn", with_stats=True)
    kv_cache = torch.zeros(10, 2, 64, 2 * 64, dtype=torch.bfloat16)  # vLLM's logical shape
    summaries = state.summaries_for(kv_cache, 2, 64, "mvar")
    assert summaries.shape == (10, 2, 2, 64) and summaries.dtype == torch.bfloat16
    summaries.fill_(3)
    assert state.summaries_for(kv_cache, 2, 64, "mvar") is summaries  # kept: never re-zeroed
    assert PageStatsLog.layers["model.layers.0.self_attn.attn"] is state.page_stats
    other = torch.zeros_like(kv_cache)
    assert (state.summaries_for(other, 2, 64, "mvar") == 0).all()  # a new cache: new summaries
    coded = LayerState("model.layers.1.self_attn.attn", with_stats=False)
    assert coded.summaries_for(kv_cache, 2, 64, "int2").shape == (10, 2, 10, 64)


def test_summaries_of_vllm_packed_cache_views_match_the_reference():
    """The plugin summarizes K = kv_cache.transpose(1, 2)[..., :D] of vLLM's packed cache."""
    keys, values = make_cache(6, 2, 64)
    packed = torch.cat([keys, values], dim=-1).transpose(1, 2).contiguous()  # (B, H, 64, 2D)
    key_view = packed.transpose(1, 2).split(64, dim=-1)[0]
    summaries = torch.zeros(6, 2, 2, 64, dtype=torch.float32, device=DEVICE)
    slots = torch.tensor([2 * 64 + 63, 5 * 64 + 10, -1, 4 * 64 + 63], device=DEVICE)
    moira.update_summaries(key_view, slots, summaries)
    expected = moira.reference.summarize(keys.float().cpu(), torch.tensor([[2, 4]]).int(),
                                         torch.tensor([128]).int())
    assert torch.allclose(summaries[[2, 4]].cpu(), expected[[2, 4]], atol=1e-5)
    assert (summaries[[0, 1, 3, 5]] == 0).all()  # pages not completed: untouched


def test_page_stats_log_reports_the_fraction_read_per_interval():
    PageStatsLog.layers.clear()
    now = [0.0]
    lines = []
    log = PageStatsLog(10.0, clock=lambda: now[0], log=lines.append)
    PageStatsLog.layers.update(a=torch.tensor([30, 100]), b=torch.tensor([10, 100]))
    assert log.maybe_log() is None  # not due yet
    now[0] = 11.0
    assert "read 20.0% of their KV pages" in log.maybe_log()
    PageStatsLog.layers["a"] += torch.tensor([50, 100])
    now[0] = 22.0
    assert "read 50.0%" in log.maybe_log() and "max 50.0%" in lines[-1]
    assert PageStatsLog(0).maybe_log() is None  # off
    PageStatsLog.layers.clear()


def test_bf16_ulps_and_dense_check_counters():
    reference = torch.tensor([1.0, 1.0, -2.0, 0.0]).bfloat16()
    value = torch.tensor([1.0, 1.0078125, -2.03125, 0.0]).bfloat16()  # 0, 1, 2 ulps, 0
    assert bf16_ulps(value, reference).tolist() == [0.0, 1.0, 2.0, 0.0]
    DenseCheck.layers.clear()
    far = torch.tensor([1.0, 1.0625, -2.0, 0.0]).bfloat16()  # 8 ulps off in one element
    # at the head's scale (largest |value| 2, spacing 2**-6) no element is beyond 1 ulp
    assert bf16_ulps(value, reference, torch.tensor(2.0)).tolist() == [0.0, 0.5, 2.0, 0.0]
    DenseCheck.add("l0", value, reference, far, torch.ones(3), torch.tensor([1.0, 2.0, 1.0]))
    assert DenseCheck.read() == {"l0": dict(
        moira_max_ulps=2.0, moira_over_1_ulp=1.0, moira_over_4_ulps=0.0, decode_elements=4.0,
        fa3_split_max_ulps=8.0, fa3_split_over_1_ulp=1.0, fa3_split_over_4_ulps=1.0,
        other_rows_differing=1.0, other_elements=3.0, moira_max_abs=0.03125,
        moira_over_1_head_ulp=1.0, fa3_split_max_abs=0.0625, fa3_split_over_1_head_ulp=1.0,
        moira_exact_abs_sum=0.0, fa3_exact_abs_sum=0.0, fa3_split_exact_abs_sum=0.0,
        moira_exact_max_abs=0.0, fa3_exact_max_abs=0.0, fa3_split_exact_max_abs=0.0,
        moira_exact_outward_sum=0.0, fa3_exact_outward_sum=0.0,
        fa3_split_exact_outward_sum=0.0)}
    DenseCheck.layers.clear()
    # against the exact (float32) result: each kernel's own error, summed and at its largest
    # (the last element: exact small and positive, every kernel 0: an error toward zero that
    # a sign taken from the kernels' outputs instead of the exact value would not count)
    exact = torch.tensor([1.0, 1.0, -2.015625, 0.01])
    DenseCheck.add("l0", value, reference, far, torch.ones(3), torch.ones(3), exact)
    counters = DenseCheck.read()["l0"]
    assert counters["moira_exact_abs_sum"] == pytest.approx(0.0078125 + 0.015625 + 0.01)
    assert counters["fa3_exact_abs_sum"] == pytest.approx(0.015625 + 0.01)
    assert counters["fa3_split_exact_abs_sum"] == pytest.approx(0.0625 + 0.015625 + 0.01)
    assert (counters["moira_exact_max_abs"], counters["fa3_exact_max_abs"],
            counters["fa3_split_exact_max_abs"]) == (0.015625, 0.015625, 0.0625)
    # along the exact value's sign: Moira +0.0078 (1 -> 1.0078) and +0.0156 (-2.0156 ->
    # -2.03125), both away from zero; FA3 -0.0156 (-2.0156 -> -2.0, toward zero); and all
    # three -0.01 (0.01 -> 0)
    assert counters["moira_exact_outward_sum"] == pytest.approx(0.0078125 + 0.015625 - 0.01)
    assert counters["fa3_exact_outward_sum"] == pytest.approx(-0.015625 - 0.01)
    assert counters["fa3_split_exact_outward_sum"] == pytest.approx(0.0625 - 0.015625 - 0.01)
    DenseCheck.layers.clear()



def test_full_read_threshold_is_on_the_steps_work():
    assert full_read_pages(0, 1) == 0  # off
    assert full_read_pages(16384, 1) == 256  # one request: rows of up to 16k tokens
    assert full_read_pages(16384, 4) == 64
    assert full_read_pages(16384, 32) == 8  # a full batch keeps selecting
    assert full_read_pages(16384, 0) == 256  # no decode rows: unused, but defined


def test_eager_steps_plan_for_the_batch_a_graph_would_replay():
    assert [planning_batch(n) for n in (0, 1, 2, 3, 5, 8, 9, 17, 24, 33)] == \
        [1, 1, 2, 4, 8, 8, 16, 32, 32, 64]
    # vLLM 0.26's default capture sizes (vllm/config/vllm.py): a FULL-graph step of n
    # requests replays the smallest one >= n; an eager step of the same n requests must plan
    # for the same batch
    capture_sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    for n in range(1, 513):
        padded = min(size for size in capture_sizes if size >= n)
        assert planning_batch(n) == planning_batch(padded), n
