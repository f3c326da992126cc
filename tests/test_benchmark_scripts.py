"""The arithmetic inside the benchmark scripts that turns raw GPU output into reported numbers."""

import argparse
import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

import moira

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def load(name):
    if BENCHMARKS not in sys.path:  # the scripts import their siblings (readme_section, ...)
        sys.path.insert(0, BENCHMARKS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def top(logprobs, k):
    order = torch.argsort(logprobs, descending=True)[:k]
    return order.numpy().astype(np.int32), logprobs[order].numpy().astype(np.float32)


@pytest.mark.parametrize("k", [5, 50, 1000])
def test_coarse_kl_is_a_tight_lower_bound(k):
    accuracy = load("report")
    generator = torch.Generator().manual_seed(k)
    vocab = 1000
    p = torch.log_softmax(3 * torch.randn(vocab, generator=generator, dtype=torch.float64), -1)
    q = torch.log_softmax(p + 0.3 * torch.randn(vocab, generator=generator,
                                                dtype=torch.float64), -1)
    exact = float((p.exp() * (p - q)).sum())
    value, lumped = accuracy.coarse_kl(*top(p, k), *top(q, k))
    assert value <= exact + 1e-6  # coarsening never raises KL
    # only tokens in both lists count as seen: at least p's mass outside its own top k
    assert lumped >= 1 - float(p[torch.from_numpy(top(p, k)[0]).long()].exp().sum()) - 1e-6
    if k == vocab:
        assert value == pytest.approx(exact, rel=1e-3)
        assert lumped < 1e-4
    same, _ = accuracy.coarse_kl(*top(p, k), *top(p, k))
    assert abs(same) < 1e-5


def test_coarse_kl_of_disjoint_lists_lumps_everything():
    accuracy = load("report")
    ids_p, ids_q = np.array([1, 2], np.int32), np.array([3, 4], np.int32)
    half = np.array([math.log(0.5)] * 2, np.float32)
    value, lumped = accuracy.coarse_kl(ids_p, half, ids_q, half)
    assert lumped == pytest.approx(1.0)
    assert value == pytest.approx(0.0, abs=1e-6)  # both lumped outcomes hold (numerically) 1


def test_accuracy_arms_apply_the_rule_to_every_row():
    """Accuracy arms measure the selection rule: the plugin's full reads of short rows at small
    batches (its default ``dense_below_tokens``) are off in every Moira arm."""
    from moira.integrations.vllm.settings import MoiraSettings

    accuracy = load("accuracy")
    assert accuracy.arm_settings("dense") is None
    for arm, expected in (("0.98", {"gamma": 0.98}), ("top_k=193", {"top_k": 193})):
        settings = accuracy.arm_settings(arm)
        assert settings == dict(expected, dense_below_tokens=0)
        assert MoiraSettings.from_sources({"moira": settings}, {}).dense_below_tokens == 0
    assert sorted(["top_k=9", "1.0", "0.95", "top_k=10"], key=accuracy.arm_order) == [
        "0.95", "1.0", "top_k=9", "top_k=10"]
    with pytest.raises(SystemExit, match="gamma must lie in"):
        accuracy.arm_settings("1.5")


def test_tpot_report_counts_a_default_moira_run_at_the_batch_shapes(tmp_path):
    """The plugin's default reads short requests in full (``dense_below_tokens`` > 0); a Moira run
    with it is the γ column at the batch shapes, and the last column of the single-request
    table, never both columns there."""
    import json

    report = load("report")

    def run(backend, tpot, dense_below=None):
        return dict(backend=backend, model="llama-3.1-8b", gamma=0.98,
                    dense_below_tokens=dense_below,
                    results=[dict(shape=shape, tpot_ms=tpot, imposed_read_fraction=0.3)
                             for shape in ("32k16", "2k1")])

    (tmp_path / "dense.json").write_text(json.dumps(run("dense", 20.0)))
    (tmp_path / "moira.json").write_text(json.dumps(run("moira", 10.0, 16384)))
    runs = report.tpot_load([str(tmp_path)])
    text, rows = report.tpot_table(runs)
    batch = next(row for row in rows if row["shape"] == "32k16")
    assert batch["g0.98"]["speedup"] == 2.0
    single = report.single_table(runs)
    assert "| 2k1 | 20.00 | – | – | – | 10.00 (N = 16384) | -50.0% |" in single
    # a second model's runs in another folder join the same table; a run twice is an error
    other = tmp_path / "qwen"
    other.mkdir()
    for name, backend, tpot in (("dense.json", "dense", 30.0), ("moira.json", "moira", 12.0)):
        (other / name).write_text(json.dumps(dict(run(backend, tpot), model="qwen3-4b")))
    text, rows = report.tpot_table(report.tpot_load([str(tmp_path), str(other)]))
    assert [(row["model"], row["g0.98"]["speedup"]) for row in rows if row["shape"] == "32k16"] \
        == [("llama-3.1-8b", 2.0), ("qwen3-4b", 2.5)]
    with pytest.raises(SystemExit, match="two runs"):
        report.tpot_load([str(tmp_path), str(tmp_path)])


def test_accuracy_merge_keeps_every_part_of_an_earlier_merge(tmp_path):
    import json
    report = load("report")
    head = dict(model="m", context=64, documents=2, date="2026-11-30")
    kl_rows = [dict(gamma=0.98, kl=0.01 * doc, read_fraction=0.5, doc=doc) for doc in (1, 2)]
    ablation_rows = [dict(arm=arm, doc=doc, kl=0.1, read_fraction=0.3)
                     for arm in ("coverage", "fixed") for doc in (1, 2)]
    parts = {"kl.json": dict(head, rows=dict(kl=kl_rows), command="eval kl", seconds=10.0),
             "retrieval.json": dict(head, rows=dict(retrieval=[
                 dict(sample=0, kind="pass-key", gamma=gamma, correct=True, read_fraction=0.5)
                 for gamma in (None, 0.98)]), command="eval retrieval", seconds=20.0),
             "ablation.json": dict(head, rows=dict(ablation=ablation_rows), command="eval ablation",
                                   seconds=30.0)}
    for name, part in parts.items():
        (tmp_path / name).write_text(json.dumps(part))
    first = report.accuracy_merge([str(tmp_path / "kl.json"), str(tmp_path / "retrieval.json")],
                                  str(tmp_path / "merged.json"))
    second = report.accuracy_merge([first, str(tmp_path / "ablation.json")],
                                   str(tmp_path / "again.json"))
    merged = json.loads(open(second).read())
    assert [p["file"] for p in merged["parts"]] == ["kl.json", "retrieval.json", "ablation.json"]
    assert merged["seconds"] == 60.0 and set(merged["rows"]) == {"kl", "retrieval", "ablation"}
    assert merged["table"]["0.98"]["kl"] == pytest.approx(0.015)
    assert set(merged["table"]["ablation"]) == {"coverage", "fixed"}


def test_first_difference_gap_pairs_prompts_and_counts_agreement_as_full_length():
    compare = load("vllm_checks")

    def run(*sequences):
        return [dict(tokens=list(seq), logprobs=[0.0] * len(seq)) for seq in sequences]

    dense = run([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9])
    halves = run([1, 2, 0, 4], [5, 6, 7, 8], [9, 0, 9, 9])  # first differences 2, none, 1
    moira = run([0, 2, 3, 4], [5, 6, 7, 0], [9, 9, 9, 9])  # 0, 3, none
    gap = compare.first_difference_gap(dict(dense=dict(full=dense, halves=halves),
                                            moira_graph=dict(full=moira)))
    assert gap["prompts"] == 3
    assert gap["dense"] == pytest.approx((2 + 4 + 1) / 3)
    assert gap["moira"] == pytest.approx((0 + 3 + 4) / 3)
    assert gap["moira_minus_dense"]["mean"] == pytest.approx(0.0)
    assert gap["moira_minus_dense"]["low"] <= 0 <= gap["moira_minus_dense"]["high"]
    assert compare.first_difference_gap(dict(dense=dict(full=dense))) is None
    assert "dense_splits1" not in gap and "moira_minus_dense_splits1" not in gap
    # with FA3 at one split as a second yardstick: its pair, and Moira's pair against it
    splits1 = run([1, 2, 3, 4], [5, 0, 7, 8], [9, 9, 9, 0])  # none, 1, 3
    gap = compare.first_difference_gap(dict(dense=dict(full=dense, halves=halves),
                                            moira_graph=dict(full=moira),
                                            dense_splits1=dict(full=splits1)))
    assert gap["dense_splits1"] == pytest.approx((4 + 1 + 3) / 3)
    assert gap["dense_splits1_minus_dense"]["mean"] == pytest.approx((8 - 7) / 3)
    assert gap["moira_minus_dense_splits1"]["mean"] == pytest.approx((7 - 8) / 3)
    alone = compare.first_difference_gap(dict(dense=dict(full=dense, halves=halves),
                                              dense_splits1=dict(full=splits1)))
    assert "moira" not in alone and alone["dense_splits1"] == gap["dense_splits1"]
    assert not any(key.startswith("moira_minus_dense_") for key in alone)
    # FlashInfer's kernel as a third: its pair against FA3, and Moira's pair against it
    flashinfer = run([1, 0, 3, 4], [5, 6, 7, 8], [0, 9, 9, 9])  # 1, none, 0
    gap = compare.first_difference_gap(dict(dense=dict(full=dense, halves=halves),
                                            moira_graph=dict(full=moira),
                                            dense_splits1=dict(full=splits1),
                                            dense_flashinfer=dict(full=flashinfer)))
    assert gap["dense_flashinfer"] == pytest.approx((1 + 4 + 0) / 3)
    assert gap["dense_flashinfer_minus_dense"]["mean"] == pytest.approx((5 - 7) / 3)
    assert gap["moira_minus_dense_flashinfer"]["mean"] == pytest.approx((7 - 5) / 3)
    assert gap["moira_minus_dense_splits1"]["mean"] == pytest.approx((7 - 8) / 3)


def test_prompt_token_ids_are_random_ids_or_a_slice_of_the_text():
    import random

    checks = load("vllm_checks")
    ids = checks.token_ids(random.Random(0), 50)
    assert len(ids) == 50 and all(100 <= i < 120000 for i in ids)
    text = list(range(1000, 1100))
    sliced = checks.token_ids(random.Random(1), 30, text)
    start = text.index(sliced[0])
    assert sliced == text[start:start + 30]
    assert checks.token_ids(random.Random(2), 100, text) == text  # the whole text fits once
    with pytest.raises(ValueError, match="fewer than a prompt"):
        checks.token_ids(random.Random(0), 101, text)


def test_step_report_puts_each_backend_and_the_papers_rows_under_each_shape():
    report = load("report")

    def run(classes):
        return dict(results=[dict(shape="130k4", per_step_ms=classes,
                                  total_ms=sum(classes.values()), gpu_idle_ms_per_step=1.0,
                                  wall_ms_per_step=12.0)])

    text = report.step_table([("", "dense", run(dict(FA3=15.0, GEMM=4.0))),
                         ("", "moira", run(dict(Attend=2.5, Estimate=0.5, GEMM=4.0)))])
    lines = text.splitlines()
    assert lines[2] == "| 130k4 | dense FA3 | – | – | – | – | 15.00 | 4.00 | – | **19.00** | " \
        "– | 1.00 | 12.00 |"
    assert lines[3].startswith("| 130k4 | Moira | 2.50 | 0.50 | – | – | – | 4.00 |")
    assert lines[4].startswith("| 130k4 | paper, dense | – | – | – | – | 15.76 |")
    assert lines[5].startswith("| 130k4 | paper, Moira | 2.78 | 0.43 | 0.42 | 0.13 | – | 3.83 |")
    assert lines[5].endswith("| 8.18 (step) | – | – | – |")
    # the waits before Moira's four kernels, summed; other classes' waits left out
    row = run(dict(Attend=2.5))["results"][0]
    row["gap_before_ms_per_step"] = dict(Estimate=0.014, Select=0.023, Attend=0.015,
                                         Merge=0.010, other=1.7)
    assert report.moira_waits(row) == "0.062"
    assert " | 0.062 | 1.00 | 12.00 |" in report.step_table([("", "moira", dict(results=[row]))])


def test_step_report_labels_each_folders_rows_by_its_name(tmp_path):
    import json

    report = load("report")
    for folder, backends in (("before", ("dense", "moira")), ("after", ("moira",))):
        (tmp_path / folder).mkdir()
        for backend in backends:
            attend = 3.0 if folder == "before" else 2.0
            run = dict(results=[dict(shape="8k32", per_step_ms=dict(Attend=attend),
                                     total_ms=attend)])
            (tmp_path / folder / f"step-{backend}.json").write_text(json.dumps(run))
    runs = report.step_load([str(tmp_path / "before"), str(tmp_path / "after")])
    lines = report.step_table(runs).splitlines()
    assert [line.split(" | ")[1] for line in lines[2:5]] == ["dense FA3 (before)",
                                                            "Moira (before)", "Moira (after)"]
    assert lines[4].split(" | ")[2] == "2.00"
    assert report.step_load([str(tmp_path / "after")])[0][0] == ""


def test_step_report_plot_stacks_each_runs_classes_to_its_kernel_total(tmp_path, monkeypatch):
    import matplotlib.axes

    report = load("report")

    def run(classes):
        return dict(results=[dict(shape="8k2", per_step_ms=classes,
                                  total_ms=sum(classes.values()))])

    runs = [("", "moira", run(dict(Attend=0.77, Estimate=0.07, Merge=0.12, GEMM=3.96))),
            ("", "dense", run(dict(FA3=0.87, GEMM=3.90)))]
    drawn = []
    original = matplotlib.axes.Axes.barh

    def record(self, y, widths, left=None, **kwargs):
        drawn.append((kwargs["label"], list(widths), list(left)))
        return original(self, y, widths, left=left, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", record)
    report.step_plot(runs, str(tmp_path / "step.png"))
    assert (tmp_path / "step.png").is_file()
    # dense first, as in the table; a class no run has (Select) draws nothing; each segment
    # starts where the run's previous classes end
    assert [label for label, _, _ in drawn] == ["Attend", "Estimate", "Merge", "FA3", "GEMM"]
    assert drawn[0][1] == [0.0, 0.77] and drawn[3][1] == [0.87, 0.0]
    assert drawn[4][2] == pytest.approx([0.87, 0.96])


def write_two_pairs(folder, gamma, shape, reads):
    """Two pair folders of tpot_pairs.sh results: dense 20 / 21 ms, Moira at ``gamma`` 10 / 7
    ms (speedups 2× / 3×), one shape."""
    import json

    for pair, (dense, sparse) in enumerate([(20.0, 10.0), (21.0, 7.0)], start=1):
        (folder / f"pair{pair}").mkdir()
        for name, backend, tpot in (("d.json", "dense", dense), ("m.json", "moira", sparse)):
            run = dict(backend=backend, model="llama-3.1-8b", gamma=gamma,
                       results=[dict(shape=shape, tpot_ms=tpot, imposed_read_fraction=reads)])
            (folder / f"pair{pair}" / name).write_text(json.dumps(run))


def test_tpot_pairs_table_gives_each_pairs_speedup_and_their_mean(tmp_path):
    import json

    report = load("report")

    def pairs_text():
        return report.pairs_table([report.tpot_load([str(tmp_path / f"pair{i}")]) for i in (1, 2)])

    write_two_pairs(tmp_path, gamma=0.98, shape="130k4", reads=0.15)
    text = pairs_text()
    assert "| llama-3.1-8b | 130k4 | 20.00 / 21.00 | 10.00 / 7.00 | 2.00× / 3.00× | **2.50×** " \
        "| 2.64× |" in text
    assert "one launch" not in text
    # a third engine per pair with Estimate and Select in one launch (the fused_select option,
    # removed since: its result files still load): its own columns, each pair's speedup
    # against that pair's dense engine
    for pair, tpot in ((1, 8.0), (2, 10.5)):
        run = dict(backend="moira", model="llama-3.1-8b", gamma=0.98, fused_select=True,
                   results=[dict(shape="130k4", tpot_ms=tpot, imposed_read_fraction=0.15)])
        (tmp_path / f"pair{pair}" / "f.json").write_text(json.dumps(run))
    text = pairs_text()
    assert "| 2.00× / 3.00× | **2.50×** | 2.64× | 2.50× / 2.00× | **2.25×** |" in text
    # only the second pair has it: the first pair's place shows "–"
    (tmp_path / "pair1" / "f.json").unlink()
    text = pairs_text()
    assert "| 2.64× | – / 2.00× | **2.00×** |" in text
    # Moira at Table 7's reads (γ = 0.99, tpot_pairs.sh arm g099) in the second pair only,
    # with the plugin's short-row fallback recorded as every plugin run is: its own columns,
    # before the fused one, the paper's Table 7 figure beside them
    run = dict(backend="moira", model="llama-3.1-8b", gamma=0.99, dense_below_tokens=20480,
               results=[dict(shape="130k4", tpot_ms=8.4, imposed_read_fraction=0.22)])
    (tmp_path / "pair2" / "g.json").write_text(json.dumps(run))
    text = pairs_text()
    assert "Moira γ=0.99 (ms) | speedup per pair | mean | paper (Table 7) |" in text
    assert "| **2.50×** | 2.64× | – / 8.40 | – / 2.50× | **2.50×** | 2.27× | – / 2.00× |" in text
    # an engine with Attend's split set (tpot_pairs.sh arm n1024) in the first pair: a column
    # pair of its own after the fused one's
    run = dict(backend="moira", model="llama-3.1-8b", gamma=0.98, dense_below_tokens=20480,
               min_programs=1024,
               results=[dict(shape="130k4", tpot_ms=9.6, imposed_read_fraction=0.15)])
    (tmp_path / "pair1" / "n.json").write_text(json.dumps(run))
    text = pairs_text()
    assert text.splitlines()[0].endswith(
        "one launch: speedup per pair | mean | Moira, Attend's split set (floor_rows, "
        "min_programs, min_chunks_per_row: in its JSON): speedup per pair | mean |")
    assert text.splitlines()[2].endswith(
        "| – / 2.00× | **2.00×** | 2.08× / – | **2.08×** |")
    # and one with J uncapped (tpot_pairs.sh arm jnocap) in the same pair: a column of its own
    run = dict(run, min_programs=None, max_chunks_per_row=4096,
               results=[dict(shape="130k4", tpot_ms=10.0, imposed_read_fraction=0.15)])
    (tmp_path / "pair1" / "j.json").write_text(json.dumps(run))
    text = pairs_text()
    assert text.splitlines()[0].endswith(
        "in its JSON): speedup per pair | mean | Moira, J from Eq. 4 alone (max_chunks_per_row "
        "4096: no ceiling on J): speedup per pair | mean |")
    assert text.splitlines()[2].endswith(
        "| 2.08× / – | **2.08×** | 2.00× / – | **2.00×** |")
    # the arm hnd (VLLM_KV_CACHE_LAYOUT=HND) in the second pair: a column of its
    # own, apart from the default engine's
    run = dict(backend="moira", model="llama-3.1-8b", gamma=0.98, kv_cache_layout="HND",
               results=[dict(shape="130k4", tpot_ms=7.0, imposed_read_fraction=0.15)])
    (tmp_path / "pair2" / "h.json").write_text(json.dumps(run))
    header, _, row = pairs_text().splitlines()[:3]
    assert header.endswith("Moira on vLLM's head-major cache (VLLM_KV_CACHE_LAYOUT=HND): "
                           "speedup per pair | mean |")
    assert row.endswith("| – / 3.00× | **3.00×** |")


def test_tpot_pairs_table_keeps_pairs_of_dense_and_moira_at_gamma_0_99_alone(tmp_path):
    report = load("report")
    write_two_pairs(tmp_path, gamma=0.99, shape="64k8", reads=0.22)
    text = report.pairs_table([report.tpot_load([str(tmp_path / f"pair{i}")]) for i in (1, 2)])
    # no pair ran γ = 0.98: its columns are left out
    assert text.splitlines()[0] == ("| model | shape | dense FA3 (ms) | Moira γ=0.99 (ms) | "
                                    "speedup per pair | mean | paper (Table 7) |")
    assert "| llama-3.1-8b | 64k8 | 20.00 / 21.00 | 10.00 / 7.00 | 2.00× / 3.00× | **2.50×** " \
        "| 2.16× |" in text
    # a pair of dense engines alone has no row
    for pair in (1, 2):
        (tmp_path / f"pair{pair}" / "m.json").unlink()
    text = report.pairs_table([report.tpot_load([str(tmp_path / f"pair{i}")]) for i in (1, 2)])
    assert "64k8" not in text


def test_tpot_report_gives_the_fused_cache_write_its_own_column(tmp_path):
    import json

    report = load("report")
    moira = dict(backend="moira", dense_below_tokens=20480)

    def single_table(runs):
        for name, extra, tpot in runs:
            run = dict(model="llama-3.1-8b", gamma=0.98, **extra,
                       results=[dict(shape="8k1", tpot_ms=tpot, imposed_read_fraction=1.0)])
            (tmp_path / f"{name}.json").write_text(json.dumps(run))
        return report.single_pairs_table([report.tpot_load([str(tmp_path)])]).splitlines()

    lines = single_table((("d", dict(backend="dense"), 5.0), ("m", moira, 5.15),
                          ("f", dict(moira, fused_cache_write=True), 5.07)))
    assert lines[0].endswith("K/V written in Estimate's launch (ms) | vs dense per pair | mean |")
    assert lines[2].endswith("| 5.15 | +3.0% | **+3.0%** | 5.07 | +1.4% | **+1.4%** |")
    # the write in Estimate is the default: the runs record it, and the
    # engine without it is the variant
    on = dict(plugin_defaults=dict(fused_cache_write=True))
    lines = single_table((("m", dict(moira, fused_cache_write=True, **on), 5.07),
                          ("f", dict(moira, fused_cache_write=False, **on), 5.15)))
    assert lines[0].endswith("K/V written by vLLM's kernel (ms) | vs dense per pair | mean |")
    assert lines[2].endswith("| 5.07 | +1.4% | **+1.4%** | 5.15 | +3.0% | **+3.0%** |")


def test_bench_cache_write_plots_every_arm_of_every_row(tmp_path, monkeypatch):
    import json

    bench = load("kernel_bench")
    rows = [dict(context=8192, batch=1, rows=mode, us=dict(estimate=1.0, fused=1.2, separate=5.0))
            for mode in ("select", "full_rows")]
    path = tmp_path / "cache-write.json"
    path.write_text(json.dumps(dict(results=rows)))
    drawn = []
    import matplotlib.axes

    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, x, heights, *a, **k: drawn.append(list(heights)))
    bench.cache_write_plot(str(path))
    assert drawn == [[1.0, 1.0], [1.2, 1.2], [5.0, 5.0]]
    assert (tmp_path / "cache-write.png").exists()


def test_every_kernel_compiles_for_the_h200_without_spilling():
    """On any machine: Triton's wheel carries ptxas, so the GPU build of every kernel (not the
    interpreter's view of it) is checked here, before device time is spent on a kernel that
    does not compile."""
    import os
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__),
                                       "backends/nvidia/bin/ptxas")):
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks",
                          "compile_check.py")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    # the register ceilings' candidate builds may spill (compile_check.py reports, not fails)
    lines = [line for line in done.stdout.splitlines()
             if "registers" in line and "max registers" not in line]
    assert len(lines) >= 28 and all("spilled bytes 0" in line for line in lines), done.stdout
    assert done.stdout.count("max registers") == 7, done.stdout


def test_serve_report_puts_dense_first_and_compares_each_arm_on_its_own_workload(tmp_path):
    import json

    report = load("report")
    base = dict(set="A", concurrency=16, requests=32, completed=32, output_tokens=1024,
                median_tpot_ms=20.0, median_ttft_s=7.0, wall_s=60.0, date="2026-11-30 07:40:00")
    for label, rate, requests in (("moira", 150.0, 32), ("dense", 100.0, 32),
                                  ("flashinfer", 110.0, 32), ("moira", 90.0, 16)):
        run = dict(base, label=label, output_tokens_per_s=rate, requests=requests)
        (tmp_path / f"serve-{label}-A-16-{requests}.json").write_text(json.dumps(run))
    lines = report.serve_table(report.serve_load([str(tmp_path)])).splitlines()
    assert [line.split(" | ")[3] for line in lines[2:]] == [
        "Moira",  # 16 prompts: no dense run of that workload, so no ratio
        "dense FA3", "dense FlashInfer", "Moira"]
    assert lines[2].split(" | ")[6] == "–"
    assert lines[4].split(" | ")[6] == "**+10.0%**" and lines[5].split(" | ")[6] == "**+50.0%**"
    # a server run with other MOIRA_* settings is its own arm, compared with the same dense run
    run = dict(base, label="moira", output_tokens_per_s=120.0,
               moira_environment={"MOIRA_EXACT_PREFILL": "0"})
    (tmp_path / "serve-moira-A-16-off.json").write_text(json.dumps(run))
    rows = [line.split(" | ") for line in
            report.serve_table(report.serve_load([str(tmp_path)])).splitlines()]
    assert [(row[3], row[6]) for row in rows[3:]] == [
        ("dense FA3", "–"), ("dense FlashInfer", "**+10.0%**"), ("Moira", "**+50.0%**"),
        ("Moira (MOIRA_EXACT_PREFILL=0)", "**+20.0%**")]


def test_serve_report_splits_per_request_changes_at_the_full_read_bound(tmp_path):
    import json

    report = load("report")

    def record(tokens, tpot):
        return dict(prompt_tokens=tokens, ok=True, tokens=1024, ttft_s=0.1, tpot_ms=tpot)

    base = dict(set="A", concurrency=1, output_tokens=1024, wall_s=10.0, completed=2)
    # slice 0: a prompt read in full (4,000 + 1,024 <= 20,480) 3% slower, one of 30,000 8% faster
    for label, tpots in (("dense", (5.0, 6.0)), ("moira", (5.15, 5.52))):
        run = dict(base, label=label, offset=0, requests=2,
                   per_request=[record(4000, tpots[0]), record(30000, tpots[1])])
        (tmp_path / f"serve-{label}-A-1-o0.json").write_text(json.dumps(run))
    # slice 2: 19,456 + 1,024 = 20,480 is still read in full, 1% slower
    for label, tpot in (("dense", 5.0), ("moira", 5.05)):
        run = dict(base, label=label, offset=2, requests=1, per_request=[record(19456, tpot)])
        (tmp_path / f"serve-{label}-A-1-o2.json").write_text(json.dumps(run))
    # another arm's settings are not Moira's default: left out
    run = dict(base, label="moira", offset=0, requests=2, moira_environment={"MOIRA_X": "1"},
               per_request=[record(4000, 50.0), record(30000, 50.0)])
    (tmp_path / "serve-moira-A-1-o0-x.json").write_text(json.dumps(run))
    changes = report.per_request_changes([str(tmp_path)])
    full, selected = changes[("A", 1)]["read in full"], changes[("A", 1)]["selected"]
    assert full == pytest.approx([3.0, 1.0]) and selected == pytest.approx([-8.0])
    assert report.per_request_changes([str(tmp_path)], from_offset=2)[("A", 1)] == {
        "read in full": pytest.approx([1.0]), "selected": [], "all": []}
    lines = report.per_request_lines(changes)
    assert lines[0] == ("set A, concurrency 1, read in full: 2 requests, Moira's TPOT +2.00% on "
                        "average (+1.0 to +3.0%), 1 over +2%")
    # in a batch the plugin reads no row in full: short prompts are not split out there
    for label, tpot in (("dense", 5.0), ("moira", 4.0)):
        run = dict(base, label=label, concurrency=16, offset=0, requests=1,
                   per_request=[record(4000, tpot)])
        (tmp_path / f"serve-{label}-A-16.json").write_text(json.dumps(run))
    assert report.per_request_changes([str(tmp_path)])[("A", 16)] == {
        "read in full": [], "selected": [], "all": pytest.approx([-20.0])}
    # the same slice in two folders is an error, not one run silently replacing the other
    with pytest.raises(AssertionError, match="twice"):
        report.per_request_changes([str(tmp_path), str(tmp_path)])


def test_tpot_report_gives_a_programmatic_launch_run_its_own_single_request_column(tmp_path):
    import json

    report = load("report")

    def run(backend, tpot, **moira):
        return dict(backend=backend, model="llama-3.1-8b", gamma=0.98,
                    results=[dict(shape="2k1", tpot_ms=tpot, imposed_read_fraction=0.4)],
                    **moira)

    (tmp_path / "dense.json").write_text(json.dumps(run("dense", 5.0)))
    (tmp_path / "moira.json").write_text(json.dumps(run("moira", 5.2, dense_below_tokens=20480)))
    (tmp_path / "moira-pdl.json").write_text(json.dumps(
        run("moira", 5.05, dense_below_tokens=20480, programmatic_launch=True)))
    single = report.single_table(report.tpot_load([str(tmp_path)]))
    assert "programmatic launch" in single.splitlines()[0]
    assert "| 2k1 | 5.00 | – | – | – | 5.20 (N = 20480) | +4.0% | 5.05 (N = 20480) | +1.0% |" \
        in single


def test_tpot_report_gives_a_run_with_attends_split_set_its_own_pairs_column(tmp_path):
    import json

    report = load("report")

    def run(backend, tpot, **moira):
        return dict(backend=backend, model="llama-3.1-8b", gamma=0.98,
                    results=[dict(shape="2k1", tpot_ms=tpot)], **moira)

    pairs = []
    for pair, (dense, sparse, split) in enumerate([(5.0, 5.1, 4.95), (5.0, 5.2, 5.05)]):
        folder = tmp_path / f"pair{pair}"
        folder.mkdir()
        (folder / "dense.json").write_text(json.dumps(run("dense", dense)))
        (folder / "moira.json").write_text(json.dumps(
            run("moira", sparse, dense_below_tokens=20480, floor_rows=None)))
        (folder / "split.json").write_text(json.dumps(
            run("moira", split, dense_below_tokens=20480, floor_rows=96, min_programs=1)))
        pairs.append(report.tpot_load([str(folder)]))
    table = report.single_pairs_table(pairs).splitlines()
    assert "Attend's split set" in table[0]
    assert table[2].endswith("| 5.10 / 5.20 | +2.0% / +4.0% | **+3.0%** | 4.95 / 5.05 | "
                             "-1.0% / +1.0% | **+0.0%** |")
    # with programmatic launch too: a column of its own, not dropped
    (folder / "both.json").write_text(json.dumps(
        run("moira", 4.9, dense_below_tokens=20480, floor_rows=96, programmatic_launch=True)))
    table = report.single_pairs_table([report.tpot_load([str(folder)])]).splitlines()
    assert "Moira, pdl+split (ms)" in table[0]
    assert table[2].endswith("| 4.90 | -2.0% | **-2.0%** |")


def test_tpot_report_pairs_the_short_shapes_and_the_short_row_floor(tmp_path):
    """Batch-4 short shapes in the short-request table (not the batch-shape one),
    and runs with step_programs set a column per value (T=0: Eq. 4 alone)."""
    import json

    report = load("report")

    def run(backend, tpots, **moira):
        return dict(backend=backend, model="llama-3.1-8b", gamma=0.98, results=[
            dict(shape=shape, tpot_ms=tpot) for shape, tpot in zip(("2k1", "2k4"), tpots)],
            **moira)

    folder = tmp_path / "pair1"
    folder.mkdir()
    (folder / "dense.json").write_text(json.dumps(run("dense", (5.0, 5.0))))
    (folder / "moira.json").write_text(json.dumps(
        run("moira", (5.05, 5.2), dense_below_tokens=20480)))
    (folder / "eq4.json").write_text(json.dumps(
        run("moira", (5.1, 5.6), dense_below_tokens=20480, step_programs=0)))
    (folder / "t256.json").write_text(json.dumps(
        run("moira", (5.0, 5.1), dense_below_tokens=20480, step_programs=256)))
    runs = report.tpot_load([str(folder)])
    assert {kind for _, kind in runs} == {"dense", "fallback", 0.98, "T=0", "T=256"}
    table = report.single_pairs_table([runs]).splitlines()
    assert "Eq. 4 alone" in table[0] and "T = 256" in table[0]
    assert table[2].endswith("| 5.05 | +1.0% | **+1.0%** | 5.10 | +2.0% | **+2.0%** | 5.00 | "
                             "+0.0% | **+0.0%** |")
    assert table[3].startswith("| llama-3.1-8b | 2k4 | 5.00 | 5.20 | +4.0% |")
    assert table[3].endswith("| 5.60 | +12.0% | **+12.0%** | 5.10 | +2.0% | **+2.0%** |")
    assert "read in full (ms)" in table[0]  # the default run did not record its split
    # runs that record the split they ran (attend_split) name the
    # default column's T
    (folder / "moira.json").write_text(json.dumps(run(
        "moira", (5.05, 5.2), dense_below_tokens=20480, attend_split=dict(step_programs=128))))
    table = report.single_pairs_table([report.tpot_load([str(folder)])]).splitlines()
    assert "read in full (T = 128) (ms)" in table[0]


def test_kernel_suite_arms_are_configurations_and_kernel_options(monkeypatch, capsys):
    from moira import KernelOptions, MoiraConfig

    bench = load("kernel_bench")
    with pytest.raises(SystemExit):
        bench.main(["suite", "--arms", "moira,moira_t256"])
    assert "unknown arms moira_t256" in capsys.readouterr().err
    # Moira under another chunk floor is an arm by its name
    assert bench.config_fields("moira_c12") == {"chunk_pages": 12}
    assert bench.config_fields("moira_eq4") == {"step_programs": 0}
    assert bench.config_fields("moira_c0") is None and bench.config_fields("moira") is None
    # Attend's page ids a tile ahead: the default configuration under other kernel options
    assert bench.config_fields("moira_ahead13") == {}
    ahead13 = {"attend.page_ids_ahead": True, "attend.pages_per_iter": 1,
               "attend.num_stages": 3}
    assert bench.arm_kernels("moira_ahead13") == dict(attend="triton", tuning=ahead13)
    assert bench.arm_kernels("moira_ahead13w8") == dict(
        attend="triton", tuning=ahead13 | {"attend.num_warps": 8})
    assert bench.arm_kernels("moira_c12") == {} and bench.config_fields("moira_ahead3") is None
    assert bench.config_fields("moira_ahead13w5") is None
    assert bench.config_fields("moira_ahead19") is None  # stages beyond the tunable's range
    # both: the floor in the workspace's configuration, the page ids in its kernel options
    assert bench.config_fields("moira_c32_ahead14") == {"chunk_pages": 32}
    assert bench.arm_kernels("moira_c32_ahead14")["tuning"]["attend.num_stages"] == 4
    assert bench.config_fields("moira_ahead13_c32") is None
    # on vLLM's packed K|V caches, alone or before the options
    assert bench.config_fields("moira_packed") == {} and bench.cache_layout("moira_packed") \
        == "packed"
    assert bench.config_fields("moira_packed_hnd") == {}
    assert bench.cache_layout("moira_packed_hnd") == "packed_hnd"
    assert bench.config_fields("moira_packed_hnd_c32_ahead14") == {"chunk_pages": 32}
    assert bench.cache_layout("moira_packed_hnd_c32_ahead14") == "packed_hnd"
    assert bench.arm_kernels("moira_packed_hnd_c32_ahead14")["tuning"]["attend.num_stages"] == 4
    assert bench.cache_layout("moira_c32") is None and bench.cache_layout("flashinfer") is None
    assert bench.config_fields("moira_hnd_packed") is None
    # the CUDA Attend, alone or after a layout and a floor; not with the lookahead
    assert bench.config_fields("moira_cuda3") == {}
    assert bench.arm_kernels("moira_cuda3") == dict(attend="cuda",
                                                   tuning={"attend.cuda_stages": 3})
    assert bench.config_fields("moira_packed_hnd_c32_cuda4") == {"chunk_pages": 32}
    assert bench.arm_kernels("moira_packed_hnd_c32_cuda4")["tuning"] == {"attend.cuda_stages": 4}
    # the Triton Attend, alone or after a layout and a floor
    assert bench.config_fields("moira_triton") == {}
    assert bench.arm_kernels("moira_triton") == dict(attend="triton")
    assert bench.config_fields("moira_packed_c32_triton") == {"chunk_pages": 32}
    assert bench.arm_kernels("moira_packed_c32_triton") == dict(attend="triton")
    for unknown in ("moira_cuda", "moira_cuda5", "moira_cuda3_ahead13", "moira_ahead13_cuda3",
                    "moira_cuda3w", "moira_cuda3w4", "moira_triton_cuda2", "moira_triton2"):
        assert bench.config_fields(unknown) is None and bench.arm_kernels(unknown) == {}
    # every arm's options are valid KernelOptions on top of the run's --kernels
    common = load("common")
    base = KernelOptions.parse("estimate=triton,estimate.num_warps=8")
    for arm in ("moira_ahead24w8", "moira_cuda4", "moira_triton", "moira_c12"):
        options = common.with_kernels(base, bench.arm_kernels(arm))
        MoiraConfig(kernels=options, **bench.config_fields(arm))
        assert options.value("estimate.num_warps") == 8
    assert common.with_kernels(base, bench.arm_kernels("moira_ahead24")).value(
        "attend.num_stages") == 4
    assert KernelOptions().value("attend.num_stages") == 2  # nothing changed globally
    with pytest.raises(SystemExit):
        bench.main(["suite", "--arms", "moira,moira_c12,moira_cx"])
    assert "unknown arms moira_cx;" in capsys.readouterr().err
    # shapes: the default four, 16k x 32 when named, nothing else
    with pytest.raises(SystemExit):
        bench.main(["suite", "--shapes", "8k32,16k32,16k16"])
    assert "unknown shapes 16k16;" in capsys.readouterr().err
    assert "16k32" not in bench.SHAPES and bench.EXTRA_SHAPES["16k32"] == (16384, 32)
    # kernel options: the text form, checked before any GPU work
    with pytest.raises(SystemExit):
        bench.main(["suite", "--kernels", "attend=cuda,attend.num_warps=8"])
    assert "read only by the triton kernel" in capsys.readouterr().err


def test_compile_check_rejects_memory_access_before_the_programmatic_wait():
    check = load("compile_check").check_waits_first
    both = "griddepcontrol.launch_dependents;\ngriddepcontrol.wait;\n"
    check("ok", "ld.param.u64 %rd1, [p];\n" + both + "ld.global.b32 %r1, [%rd1];")
    for ptx in ("ld.global.b32 %r1, [%rd1];\n" + both,  # a read before the wait
                "st.global.b32 [%rd1], %r1;\n" + both,  # a write before it
                "griddepcontrol.wait;\n"):  # no launch_dependents
        with pytest.raises(SystemExit):
            check("bad", ptx)


def test_serve_slices_are_the_whole_runs_prompts_and_pool_into_one_row(tmp_path):
    import json

    bench, report = load("vllm_serve"), load("report")
    assert bench.set_prompts("A", 2, 3) == bench.set_prompts("A", 0, 5)[2:]

    def slice_run(label, offset, tpots, wall):
        records = [dict(prompt_tokens=4096, ok=True, tokens=100, ttft_s=1.0, tpot_ms=t)
                   for t in tpots]
        return dict(label=label, set="A", concurrency=16, output_tokens=100, offset=offset,
                    requests=len(records), completed=len(records), wall_s=wall,
                    output_tokens_per_s=100 * len(records) / wall, median_tpot_ms=0.0,
                    median_ttft_s=1.0, per_request=records, command=f"slice {offset}",
                    date="2026-11-30 23:00:00" if offset == 0 else "2026-12-01 00:20:00")

    later = tmp_path / "later-session"  # slices pool across folders too
    later.mkdir()
    for label, tpots, wall in (("dense", (30.0, 31.0), 10.0), ("moira", (20.0, 21.0), 8.0)):
        (tmp_path / f"serve-{label}-A-16.json").write_text(
            json.dumps(slice_run(label, 0, tpots, wall)))
        (later / f"serve-{label}-A-16-o2.json").write_text(
            json.dumps(slice_run(label, 2, [t + 2 for t in tpots], wall)))
    folders = [str(tmp_path), str(later)]
    runs = {run["label"]: run for run in report.serve_load(folders)}
    moira = runs["moira"]
    assert (moira["requests"], moira["slices"], moira["wall_s"]) == (4, 2, 16.0)
    assert moira["output_tokens_per_s"] == 400 / 16.0
    assert moira["median_tpot_ms"] == 21.5  # of 20, 21, 22, 23
    # slices run on two days: the report's note names both
    assert report.days([moira]) == ["2026-11-30", "2026-12-01"]
    line = next(line for line in report.serve_table(list(runs.values())).splitlines()
                if "| Moira |" in line)
    assert "| 4 in 2 slices × 100 |" in line and "**+25.0%**" in line
    # a run overlapping the slices is another workload: no pooling, one row each
    (tmp_path / "serve-moira-A-16-again.json").write_text(
        json.dumps(slice_run("moira", 1, (20.0,), 4.0)))
    assert sorted(run["requests"] for run in report.serve_load(folders)
                  if run["label"] == "moira") == [1, 2, 2]


def test_gaps_at_first_difference_read_the_reference_runs_top2_gap_where_prompts_part():
    compare = load("vllm_checks")
    reference = [dict(tokens=[1, 2, 3], logprobs=[0.0] * 3, top2_gap=[2.0, 0.1, 3.0]),
                 dict(tokens=[4, 5, 6], logprobs=[0.0] * 3, top2_gap=[0.5, 0.7, 0.2])]
    other = [dict(tokens=[1, 9, 3], logprobs=[0.0] * 3),  # parts at step 1
             dict(tokens=[4, 5, 6], logprobs=[0.0] * 3)]  # never parts
    assert compare.gaps_at_first_difference(reference, other) == [0.1]
    assert compare.gaps_at_first_difference(reference, reference) == []
    # runs written before the gaps were recorded give no reading, not a wrong one
    assert compare.gaps_at_first_difference(other, reference) is None


def test_engine_checks_never_ask_vllm_for_a_graph_mode_it_would_turn_into_eager(monkeypatch,
                                                                                 capsys):
    checks = load("vllm_checks")
    assert checks.graph_mode(3, None) == "FULL_AND_PIECEWISE"
    assert checks.graph_mode(0, None) == "FULL_DECODE_ONLY"
    assert checks.graph_mode(0, "NONE") == "NONE"
    with pytest.raises(ValueError, match="needs torch.compile"):
        checks.graph_mode(0, "FULL_AND_PIECEWISE")
    with pytest.raises(ValueError, match="full CUDA graphs only"):
        checks.graph_mode(3, "NONE", fa3_max_splits=1)
    with pytest.raises(ValueError, match="needs torch.compile"):
        checks.graph_mode(0, "piecewise")
    # through the script's own argument handling, before anything imports vLLM
    monkeypatch.setattr(sys, "argv", ["vllm_checks.py", "dense", "--compile-mode", "0",
                                      "--graph-mode", "PIECEWISE"])
    with pytest.raises(SystemExit) as exit_info:
        checks.main()
    assert exit_info.value.code == 2 and "needs torch.compile" in capsys.readouterr().err
    # kernel options the engines cannot take are a usage error too, naming the known ones
    with pytest.raises(SystemExit) as exit_info:
        checks.main(["moira", "--kernels", "attend=cudnn"])
    assert exit_info.value.code == 2 and "('auto', 'triton', 'cuda')" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        checks.main(["moira", "--kernels", "attend.cuda_stage=3"])
    assert exit_info.value.code == 2 and "attend.cuda_stages" in capsys.readouterr().err
    # FA3's arithmetic is the Triton Attend's: not with the CUDA one, never in a dense engine
    with pytest.raises(SystemExit) as exit_info:
        checks.main(["moira", "--kernels", "attend=cuda,attend.cuda_stages=3",
                     "--fa3-normalizer"])
    assert exit_info.value.code == 2 and "Triton Attend" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        checks.main(["dense", "--fa3-arithmetic"])
    assert exit_info.value.code == 2 and "dense runs ignore them" in capsys.readouterr().err


def test_top2_gap_is_the_best_minus_the_second_log_prob():
    checks = load("vllm_checks")

    class Logprob:
        def __init__(self, logprob):
            self.logprob = logprob

    assert checks.top2_gap({7: Logprob(-0.2), 3: Logprob(-1.7)}) == pytest.approx(1.5)
    assert checks.top2_gap({3: Logprob(-1.7), 7: Logprob(-0.2)}) == pytest.approx(1.5)
    assert checks.top2_gap({7: Logprob(0.0)}) is None


def test_tpot_pairs_at_batch_1_compare_each_arm_to_its_own_pairs_dense_engine(tmp_path,
                                                                            monkeypatch):
    import json

    report = load("report")
    for pair, (dense, sparse, pdl) in enumerate([(5.0, 5.2, 5.1), (4.0, 4.2, 4.12)], start=1):
        folder = tmp_path / f"pair{pair}"
        folder.mkdir()
        for name, tpot, extra in (("dense", dense, dict(backend="dense")),
                                  ("moira", sparse, dict(backend="moira",
                                                        dense_below_tokens=20480)),
                                  ("pdl", pdl, dict(backend="moira", dense_below_tokens=20480,
                                                    programmatic_launch=True))):
            run = dict(model="llama-3.1-8b", gamma=0.98, **extra,
                       results=[dict(shape="2k1", tpot_ms=tpot, imposed_read_fraction=0.4)])
            (folder / f"{name}.json").write_text(json.dumps(run))
    text = report.single_pairs_table([report.tpot_load([str(tmp_path / f"pair{i}")])
                                      for i in (1, 2)])
    assert "every row selecting" not in text  # no such run: no column standing in for it
    assert "| llama-3.1-8b | 2k1 | 5.00 / 4.00 | 5.20 / 4.20 | +4.0% / +5.0% | **+4.5%** | " \
        "5.10 / 4.12 | +2.0% / +3.0% | **+2.5%** |" in text
    # the plot: a bar per arm at the pairs' mean, in percent, a dot per pair
    import matplotlib.axes

    bars, dots = [], []
    original_bar, original_plot = matplotlib.axes.Axes.bar, matplotlib.axes.Axes.plot

    def bar(self, x, height, *args, **kwargs):
        bars.append((height, kwargs.get("label")))
        return original_bar(self, x, height, *args, **kwargs)

    def plot(self, x, y, *args, **kwargs):
        dots.append(list(y))
        return original_plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    report.single_pairs_plot([report.tpot_load([str(tmp_path / f"pair{i}")]) for i in (1, 2)],
                             str(tmp_path / "pairs.png"))
    assert (tmp_path / "pairs.png").is_file()
    assert [height for height, _ in bars] == pytest.approx([4.5, 2.5])
    assert bars[1][1].startswith("the same, programmatic launch")
    assert dots[0] == pytest.approx([4.0, 5.0]) and dots[1] == pytest.approx([2.0, 3.0])
    # a run with every row selecting gets its own column, first
    run = dict(model="llama-3.1-8b", gamma=0.98, backend="moira", dense_below_tokens=0,
               results=[dict(shape="2k1", tpot_ms=6.0, imposed_read_fraction=0.4)])
    (tmp_path / "pair1" / "selecting.json").write_text(json.dumps(run))
    text = report.single_pairs_table([report.tpot_load([str(tmp_path / "pair1")])])
    assert "| 2k1 | 5.00 | 6.00 | +20.0% | **+20.0%** | 5.20 | +4.0% |" in text
    # an engine with Estimate and Select in one launch (fused_select, removed since: its
    # result files still load): its own column, last
    run = dict(model="llama-3.1-8b", gamma=0.98, backend="moira", dense_below_tokens=20480,
               fused_select=True,
               results=[dict(shape="2k1", tpot_ms=5.05, imposed_read_fraction=0.4)])
    (tmp_path / "pair1" / "fsel.json").write_text(json.dumps(run))
    text = report.single_pairs_table([report.tpot_load([str(tmp_path / "pair1")])])
    assert "Estimate + Select in one launch (ms) |" in text.splitlines()[0]
    assert text.splitlines()[2].endswith("| 5.05 | +1.0% | **+1.0%** |")
    # Merge in Attend's launch, alone and with Select in Estimate's: a column each, in that order
    for name, flags, tpot in (("fmerge", dict(fused_merge=True), 5.10),
                              ("fboth", dict(fused_merge=True, fused_select=True), 5.01)):
        run = dict(model="llama-3.1-8b", gamma=0.98, backend="moira", dense_below_tokens=20480,
                   **flags, results=[dict(shape="2k1", tpot_ms=tpot, imposed_read_fraction=0.4)])
        (tmp_path / "pair1" / f"{name}.json").write_text(json.dumps(run))
    text = report.single_pairs_table([report.tpot_load([str(tmp_path / "pair1")])])
    assert "Merge in Attend's launch (ms) |" in text.splitlines()[0]
    assert text.splitlines()[2].endswith(
        "| 5.05 | +1.0% | **+1.0%** | 5.10 | +2.0% | **+2.0%** | 5.01 | +0.2% | **+0.2%** |")
    # Attend's grid set (an arm since removed; its files stay readable): its
    # own column beside the plain Moira run
    run = dict(model="llama-3.1-8b", gamma=0.98, backend="moira", dense_below_tokens=20480,
               launched_programs=792,
               results=[dict(shape="2k1", tpot_ms=5.02, imposed_read_fraction=0.4)])
    (tmp_path / "pair1" / "launch.json").write_text(json.dumps(run))
    text = report.single_pairs_table([report.tpot_load([str(tmp_path / "pair1")])])
    assert text.splitlines()[0].endswith("| Moira, P=792 (ms) | vs dense per pair | mean |")
    assert text.splitlines()[2].endswith("| 5.02 | +0.4% | **+0.4%** |")


def test_tpot_report_plots_pairs_at_the_batch_shapes(tmp_path, monkeypatch, capsys):
    """--pairs --plot at batch shapes: each arm's TPOT against its pair's dense engine, no 2%
    bar (batch 1's); the kernel-settings arm a bar of its own."""
    report = load("report")
    for name, tpot, settings in (("dense", 12.9, None), ("moira", 9.4, None),
                                 ("kern", 9.3, {"attend.IMPLEMENTATION": "cuda"})):
        run = dict(model="llama-3.1-8b", gamma=0.98, backend=name if name == "dense" else "moira",
                   kernel_settings=settings,
                   results=[dict(shape="8k32", tpot_ms=tpot, imposed_read_fraction=0.42)])
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    _, cells, present = report.short_pair_cells([report.tpot_load([str(tmp_path)])],
                                              report.TPOT_SHAPES)
    assert [arm for arm, _ in present] == [0.98, "kern"]
    assert cells[("llama-3.1-8b", "8k32", "kern")] == [(9.3, pytest.approx(9.3 / 12.9 - 1))]
    monkeypatch.setattr(sys, "argv", ["report.py", "tpot", "--pairs", str(tmp_path), "--plot",
                                      str(tmp_path / "pairs.png")])
    report.main()
    assert "| 1.39× | **1.39×** |" in capsys.readouterr().out
    assert (tmp_path / "pairs.png").read_bytes()[:4] == b"\x89PNG"


def test_split_report_applies_the_batch_1_rule_to_the_mean_of_the_runs(tmp_path):

    def run(path, times):  # times: {context: {(floor_rows, chunks): µs}}
        results = []
        for context, arms in times.items():
            names = {key: f"split_{key[0]}_{key[1]}" for key in arms}
            results.append(dict(context=context, us_per_layer={
                names[key]: us for key, us in arms.items()},
                split_sweep={names[key]: list(key) for key in arms}))
        path.write_text(json.dumps(dict(results=results)))
        return str(path)

    default, floor2, j16 = (32, None), (96, None), (32, 16)
    first = run(tmp_path / "a.json", {2048: {default: 16.6, floor2: 14.6, j16: 16.0},
                                      8192: {default: 21.9, floor2: 24.9, j16: 21.3}})
    second = run(tmp_path / "b.json", {2048: {default: 16.7, floor2: 14.7, j16: 16.1},
                                       8192: {default: 22.0, floor2: 25.0, j16: 21.5}})
    table, chosen, verdict = load("report").split_report([first, second])
    # floor 2 is best at 2k but 3 µs off at 8k; J 16 is within 0.3 of the best at 8k (it is
    # the best) but 1.4 off at 2k: neither holds everywhere
    assert chosen is None and "not met" in verdict
    assert "**14.65 (14.60 / 14.70)" in table and "**21.40 (21.30 / 21.50)" in table
    # J 16 is also never slower than the default and faster at 2k by 0.6: the second rule's
    assert verdict.endswith("faster at batch 1: (32, 16)")
    third = run(tmp_path / "c.json", {2048: {default: 16.6, floor2: 16.0, j16: 16.1},
                                      8192: {default: 21.9, floor2: 21.8, j16: 21.5}})
    _, chosen, verdict = load("report").split_report([third])
    # both now hold (within 0.3 of the best everywhere, >= 0.5 faster than the default at
    # 2k); the faster over the contexts wins
    assert chosen == (32, 16)
    assert "(32, 16)" in verdict
    # batch 2 columns: labelled with the batch; the rule then holds there too
    run(tmp_path / "d.json", {2048: {default: 16.6, floor2: 14.6, j16: 16.0}})
    rows = json.loads((tmp_path / "d.json").read_text())
    rows["results"].append(dict(rows["results"][0], batch=2, us_per_layer={
        "split_32_None": 20.0, "split_96_None": 21.0, "split_32_16": 20.1}))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    table, chosen, verdict = load("report").split_report([str(tmp_path / "d.json")])
    assert table.splitlines()[0] == "| floor_rows, J[, T] | 2k | 2k×2 |"
    # floor 2 is 2 µs faster at batch 1 but 1 µs slower at batch 2: neither rule's; J 16 is
    # 1.4 off the best at 2k (not the first rule's) but never slower than the default
    assert chosen is None and verdict.endswith("faster at batch 1: (32, 16)")
    # the arms with the short-row floor T: their own rows, compared with Eq. 4's
    # default (T = 0, as in files written before it)
    rows = json.loads((tmp_path / "d.json").read_text())
    for row in rows["results"]:
        row["us_per_layer"]["split_t128"] = row["us_per_layer"]["split_32_None"] - 1.0
        row["split_sweep"]["split_t128"] = [32, None, 128]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    table, chosen, verdict = load("report").split_report([str(tmp_path / "d.json")])
    assert "| 32, default, T = 128 | 15.60 (15.60) `split_t128` | **19.00" in table
    assert chosen is None and verdict.endswith("faster at batch 1: (32, None, 128), (32, 16)")


def test_programs_report_means_runs_and_compares_each_n_t_with_the_default(tmp_path):
    bench_single = load("kernel_bench")
    # the J each N_T gives at a 2,048-page table, as the sweep's comment states
    assert [bench_single.programs_config(p).chunks_per_row(8, 2048)
            for p in bench_single.PROGRAMS_SWEEP] == [342, 256, 128, 64, 32]
    assert [bench_single.programs_config(p).chunks_per_row(32, 2048)
            for p in bench_single.PROGRAMS_SWEEP] == [86, 64, 32, 32, 32]
    # the default: N_T = 1024's J at batch 1, N_T = 4096's from 32 rows
    assert moira.MoiraConfig().chunks_per_row(8, 2048) == 128
    assert moira.MoiraConfig().chunks_per_row(32, 2048) == 86

    def run(path, times):  # {(context, batch): {N_T: µs}}
        results = [dict(context=context, batch=batch, us_per_layer={
            f"step_p{p}": us for p, us in arms.items()}, programs_sweep={
            f"step_p{p}": dict(min_programs=p, chunks_per_row=4096 // p) for p in arms})
            for (context, batch), arms in times.items()]
        path.write_text(json.dumps(dict(results=results)))
        return str(path)

    first = run(tmp_path / "a.json", {(8192, 1): {4096: 22.0, 512: 19.0},
                                      (131072, 4): {4096: 60.0, 512: 61.0}})
    second = run(tmp_path / "b.json", {(8192, 1): {4096: 22.2, 512: 19.4}})
    # a launched-programs arm (older files): the default N_T, its own column after the
    # N_T ones
    rows = json.loads((tmp_path / "b.json").read_text())
    rows["results"][0]["us_per_layer"]["step_launch396"] = 20.0
    rows["results"][0]["programs_sweep"]["step_launch396"] = dict(
        min_programs=4096, launched=396, chunks_per_row=342, programs_per_row=50)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    lines = load("report").programs_report([first, second]).splitlines()
    assert lines[0] == "| shape | N_T = 4096 | N_T = 512 | launch 396 |"
    assert lines[2] == ("| 8k×1 | 22.10 (J 1) | **19.20 (J 8) -2.90** | 20.00 (J 342, P 50) "
                        "-2.10 |")
    assert lines[3] == "| 128k×4 | **60.00 (J 1)** | 61.00 (J 8) +1.00 | – |"


def dense_b8_folder(tmp_path):
    """A folder ``serve-b8`` holding one dense run of set B at concurrency 8 (2 requests)."""
    run = dict(label="dense", set="B", concurrency=8, requests=2, completed=2, output_tokens=8,
               output_tokens_per_s=10.0, median_tpot_ms=50.0, median_ttft_s=9.0, wall_s=1.6,
               date="2026-11-30 21:30:00", gpu="NVIDIA H200")
    folder = tmp_path / "serve-b8"
    folder.mkdir()
    (folder / "serve-dense-B-8.json").write_text(json.dumps(run))
    return folder


def test_serve_report_writes_the_section_it_is_given_and_leaves_the_others(tmp_path, monkeypatch):
    report = load("report")
    folder = dense_b8_folder(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- serve:begin -->\nset A\n<!-- serve:end -->\n"
                      "<!-- serve-b8:begin -->\n<!-- serve-b8:end -->\n")
    monkeypatch.setattr(sys, "argv", ["report.py", "serve", str(folder), "--readme", str(readme),
                                      "--section", "serve-b8"])
    report.main()
    text = readme.read_text()
    assert "<!-- serve:begin -->\nset A\n<!-- serve:end -->" in text
    assert "| B | 8 | 2 × 8 | dense FA3 | 2/2 | 10.0 |" in text.split("serve-b8:begin")[1]


def test_serve_report_run_inside_its_folder_plots_beside_the_folder(tmp_path, monkeypatch):
    report = load("report")
    folder = dense_b8_folder(tmp_path)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "argv", ["report.py", "serve", "."])
    report.main()
    assert (tmp_path / "serve-b8.png").is_file()
    assert not list(folder.glob(".*png"))


def test_serve_report_of_several_folders_names_its_plot_and_every_folder(tmp_path, monkeypatch,
                                                                        capsys):
    report = load("report")
    first = dense_b8_folder(tmp_path)
    second = tmp_path / "serve-b8-later"
    second.mkdir()
    run = json.loads((first / "serve-dense-B-8.json").read_text())
    (second / "serve-dense-B-8-o2.json").write_text(json.dumps(dict(run, offset=2)))
    monkeypatch.setattr(sys, "argv", ["report.py", "serve", str(first), str(second)])
    with pytest.raises(SystemExit):
        report.main()
    assert "--plot" in capsys.readouterr().err
    readme = tmp_path / "README.md"
    readme.write_text("<!-- serve:begin -->\n<!-- serve:end -->\n")
    monkeypatch.setattr(sys, "argv", ["report.py", "serve", str(first), str(second), "--plot",
                                      str(tmp_path / "both.png"), "--readme", str(readme)])
    report.main()
    assert (tmp_path / "both.png").is_file() and not (tmp_path / "serve-b8.png").exists()
    text = readme.read_text()
    # no per_request records, so the two runs stay two rows (nothing to pool them from)
    assert text.count("| dense FA3 |") == 2
    assert "serve-b8/`, `" in text and "serve-b8-later/`" in text and "both.png" in text


@pytest.mark.parametrize("argv, message", [
    (["--width", "261,2048", "--programs-sweep"], "take one --width"),
    (["--width", "261,2048", "--split-sweep"], "take one --width"),
    (["--width", "26l"], "expected positive ints"),
    (["--width", "261,"], "expected positive ints"),
    (["--width", "0"], "expected positive ints"),
    (["--gemm-profile"], "add --gemm"),
    (["--gemm-probes"], "add --gemm"),
])
def test_bench_single_refuses_bad_widths_before_it_starts(monkeypatch, capsys, argv, message):
    bench_single = load("kernel_bench")
    monkeypatch.setattr(sys, "argv", ["kernel_bench.py", "single", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench_single.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.cuda
def test_bench_single_gemm_calls_counts_each_gemm_of_the_replayed_graph():
    bench_single = load("kernel_bench")
    a = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty(2, 1024, device="cuda", dtype=torch.bfloat16)

    def three_gemms():
        for w in weights:
            torch.matmul(a, w.t(), out=out)
            out.add_(1)  # not a GEMM: not counted

    calls = bench_single.gemm_calls(three_gemms, replays=4)
    # cuBLAS may add a split-K reduction per product (counted as GEMM, as in the engine)
    assert calls["calls"] in (3 * 4, 2 * 3 * 4) and 0 < calls["p10_us"] <= calls["median_us"]


def test_bench_single_times_each_shape_once_per_distinct_width():
    bench_single = load("kernel_bench")
    assert load("common").positive_ints("261,2048") == [261, 2048]
    # 8k rows (128 pages) fit both tables; 128k rows (2,048 pages) outgrow both: one 2,050
    assert bench_single.timed_shapes([8192, 131072], [1], [261, 2048]) == [
        (8192, 1, 261), (8192, 1, 2048), (131072, 1, 2050)]


def test_bench_single_pdl_arms_chain_the_triton_kernels_named_by_launch_chained():
    from moira import KernelOptions
    from moira.kernels.tuning import TUNABLES

    bench_single = load("kernel_bench")
    assert bench_single.PDL_CHAINS == {
        "_triton": None, "_pdl": "estimate,select,attend,merge",
        "_pdl_no_attend": "estimate,select,merge", "_pdl_est_sel": "estimate,select"}
    # the run's --kernels: a Triton constant kept, a CUDA kernel's dropped with its kernel
    base = KernelOptions.parse("attend=cuda,attend.cuda_stages=3,estimate=triton,"
                               "estimate.num_warps=8")
    for suffix, chained in bench_single.PDL_CHAINS.items():
        config = bench_single.pdl_config(chained, base)
        kernels = config.kernels
        assert (kernels.estimate, kernels.select, kernels.attend) == ("triton",) * 3, suffix
        assert kernels.value("estimate.num_warps") == 8
        assert "attend.cuda_stages" not in dict(kernels.tuning)
        assert config.programmatic_launch is (chained is not None)
        if chained is not None:
            assert chained in TUNABLES["launch.chained"].choices
            assert kernels.value("launch.chained") == chained
        else:  # launched plainly: the baseline of the chained arms
            assert "launch.chained" not in dict(kernels.tuning)
    # every other field of the configuration is the default's
    assert bench_single.pdl_config(None) == moira.MoiraConfig(kernels=KernelOptions(
        estimate="triton", select="triton", attend="triton"))
    assert bench_single.pdl_config("estimate,select") == moira.MoiraConfig(
        programmatic_launch=True, kernels=KernelOptions(
            estimate="triton", select="triton", attend="triton",
            tuning={"launch.chained": "estimate,select"}))


def test_bench_single_gemm_cost_is_what_the_gemm_adds_after_each_arm():
    bench_single = load("kernel_bench")
    times = {"gemm_only": 56.0, "fa3_dense": 15.0, "fa3_dense+gemm": 71.2,
             "step_full_rows": 16.0, "step_full_rows+gemm": 74.5, "estimate": 2.0}
    # an arm timed without its +gemm twin (a failed run) has no cost
    assert bench_single.gemm_costs(times) == {"fa3_dense": 56.2, "step_full_rows": 58.5,
                                              "gemm_only": 56.0}


def test_bench_single_plot_names_the_widths_when_a_run_has_several(tmp_path, monkeypatch):
    import matplotlib.axes

    bench_single = load("kernel_bench")
    rows = [dict(context=8192, batch=1, width=width, read_fraction=0.42,
                 us_per_layer=dict(fa3_dense=15.0, estimate=4.8, select=6.4, attend_merge=11.0,
                                   step_full_rows=21.0 + width / 1000))
            for width in (261, 2048)]
    # one width per shape, as a run at one --width gives (the 128k row's table is wider):
    # no width in the labels
    single = [dict(rows[0], width=1030, us_per_layer=dict(rows[0]["us_per_layer"])),
              dict(rows[0], context=131072, width=2050,
                   us_per_layer=dict(rows[0]["us_per_layer"]))]
    path = tmp_path / "single.json"
    path.write_text(json.dumps(dict(gpu="H200", date="2026-12-01", results=rows)))
    labels = []
    original = matplotlib.axes.Axes.set_xticks

    def record(self, ticks, names=None, **kwargs):
        labels.extend(names or [])
        return original(self, ticks, names, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", record)
    bench_single.single_plot(str(path))
    assert labels == ["8k, 261 pages\n(reads 0.42)", "8k, 2048 pages\n(reads 0.42)"]
    assert (tmp_path / "single.png").is_file()
    labels.clear()
    path.write_text(json.dumps(dict(gpu="H200", date="2026-12-01", results=single)))
    bench_single.single_plot(str(path))
    assert labels == ["8k\n(reads 0.42)", "128k\n(reads 0.42)"]
    # a run without vLLM has no FA3 arm: Moira's bars are still drawn
    for row in single:
        del row["us_per_layer"]["fa3_dense"]
    path.write_text(json.dumps(dict(gpu="H200", date="2026-12-01", results=single)))
    labels.clear()
    bench_single.single_plot(str(path))
    assert labels == ["8k\n(reads 0.42)", "128k\n(reads 0.42)"]


def test_tune_kernels_refuses_an_unknown_kind(monkeypatch, capsys):
    tune = load("tune")
    monkeypatch.setattr(sys, "argv", ["tune.py", "--kinds", "attend,launched"])
    with pytest.raises(SystemExit) as exit_info:
        tune.main()
    assert exit_info.value.code == 2
    assert "unknown ['launched']" in capsys.readouterr().err


def test_tune_select_warps_are_forced_through_select_num_warps():
    from moira import KernelOptions, MoiraConfig

    tune = load("tune")
    common = load("common")
    assert tune.SELECT_WARPS == (1, 2, 4, 8, 16)
    assert set(tune.QUICK_SELECT_WARPS) <= set(tune.SELECT_WARPS)
    for base in (KernelOptions(), KernelOptions.parse("select=cuda,estimate=triton,"
                                                      "estimate.num_warps=8")):
        for warps in (0, *tune.SELECT_WARPS):
            options = common.with_kernels(base, tune.select_kernels(warps))
            assert options.select == "triton" and options.value("select.num_warps") == warps
            assert options.value("select.softmax_tile") == KernelOptions().value(
                "select.softmax_tile")
        assert common.with_kernels(base, tune.select_kernels(16, softmax_tile=0)).value(
            "select.softmax_tile") == 0
    # the step's arms: the default's warps (0), 4, 8, 16, head by head, then the CUDA Select
    arms = tune.step_select_arms()
    labels = [label for label, _, _ in arms]
    assert labels == ["triton", "triton 4 warps", "triton 8 warps", "triton 16 warps",
                      "triton head by head", "triton 16 warps head by head", "cuda",
                      "cuda binned"]
    warps = {}
    for label, kernels, config in arms:
        options = common.with_kernels(KernelOptions(), kernels)
        MoiraConfig(kernels=options, **config)  # valid
        warps[label] = options.value("select.num_warps"), options.value("select.softmax_tile")
        assert options.select == ("cuda" if label.startswith("cuda") else "triton")
    assert warps["triton"][0] == 0 and warps["triton 8 warps"][0] == 8
    assert warps["triton 16 warps head by head"] == (16, 0)
    assert warps["triton head by head"] == (0, 0)
    assert arms[-1][2] == dict(bisection_ways=tune.BINNED)
    assert KernelOptions().value("select.num_warps") == 0  # nothing changed globally


def test_step_profile_call_stats_give_the_spread_of_a_kernels_calls():
    vllm_step_profile = load("vllm_step_profile")
    stats = vllm_step_profile.call_stats([5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 7.0, 8.0, 9.0, 6.0])
    assert stats == dict(calls=10, p10_us=1.0, median_us=5.5, p90_us=9.0, max_us=10.0)
    assert vllm_step_profile.call_stats([float(v) for v in range(1, 12)])["p90_us"] == 10.0
    assert vllm_step_profile.call_stats([3.0])["median_us"] == 3.0


def test_output_checks_record_agreement_difference_and_errors():
    bench = load("kernel_bench")
    report = dict(checks=[])
    reference = torch.zeros(2, 4, 8)
    bench.record_check(report, "8k32", "all pages", "near", lambda: torch.full((8, 8), 2 ** -8),
                       reference)
    bench.record_check(report, "8k32", "all pages", "far", lambda: torch.ones(64), reference)

    def failing():
        raise RuntimeError("no kernel")
    bench.record_check(report, "8k32", "all pages", "broken", failing, reference)
    near, far, broken = report["checks"]
    assert near["agrees"] and near["max_abs_diff_to_moira"] == 2 ** -8
    assert not far["agrees"] and far["max_abs_diff_to_moira"] == 1.0
    assert broken["error"] == "RuntimeError: no kernel" and "agrees" not in broken


def test_bytes_and_rates_of_the_kernel_bench():
    bench = load("kernel_bench")
    tune = load("tune")
    # K and V of one 64-token page of one KV head, head_dim 128, bf16
    assert bench.PAGE_BYTES == tune.PAGE_KV_BYTES == 2 * 64 * 128 * 2 == 32768
    # Estimate at 8k x 32 (256 rows of 128 pages), bf16 summaries: summaries 16 MiB, the sink's
    # and the current page's keys 8 MiB, G = 4 float32 log-masses per page 0.5 MiB
    assert load("common").estimate_bytes(256, 128, 2) == 16777216 + 8388608 + 524288
    assert load("common").tbps(4.3e6, 1.0) == pytest.approx(4.3)  # 4.3 MB in 1 us
    assert load("common").tbps(25690112, 12.0) == pytest.approx(2.1408, rel=1e-4)


def test_estimate_rotation_moves_the_exact_pages_and_copies_the_summaries():
    summaries = torch.randn(12, 2, 2, 8)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    wide = torch.cat([table, torch.zeros(2, 2, dtype=torch.int32)], dim=1)  # an engine's width
    rotation = load("common").estimate_rotation(summaries, wide, 6, bytes_per_call=40 << 20)
    assert len(rotation) == 4  # ceil(128 MiB / 40 MiB): more than twice the L2 in all
    assert rotation[0][0] is summaries and torch.equal(rotation[0][1], wide)
    for i, (copy, rolled) in enumerate(rotation[1:], start=1):
        assert torch.equal(copy, summaries) and copy.data_ptr() != summaries.data_ptr()
        assert torch.equal(rolled[:, :6], table.roll(i, dims=1))
        assert not rolled[:, 6:].any()  # the padding columns stay
        # the sink and the current page are other physical pages than in the call before
        assert (rolled[:, [0, 5]] != rotation[i - 1][1][:, [0, 5]]).all()


def test_serve_deadline_stops_sending_and_keeps_the_prompts_sent(monkeypatch):
    serve = load("vllm_serve")
    clock = [0.0]
    monkeypatch.setattr(serve.time, "perf_counter", lambda: clock[0])

    def completion(url, model, prompt, max_tokens):
        start = clock[0]
        clock[0] += 10.0  # each request takes 10 s
        return dict(start=start, first=start + 1.0, last=clock[0], tokens=max_tokens,
                    chunks=max_tokens, ok=True)

    monkeypatch.setattr(serve, "stream_completion", completion)
    prompts = [[1] * n for n in (100, 200, 300, 400, 500)]
    # at concurrency 1: sent at 0, 10, 20 s; not at 30 (past 25)
    result = serve.run("http://x", "m", prompts, 1, 10, deadline_s=25.0)
    assert (result["requests"], result["completed"], result["wall_s"]) == (3, 3, 30.0)
    assert [r["prompt_tokens"] for r in result["per_request"]] == [100, 200, 300]
    assert result["output_tokens_per_s"] == pytest.approx(30 / 30.0)
    # without a deadline: every prompt
    clock[0] = 0.0
    result = serve.run("http://x", "m", prompts, 1, 10)
    assert (result["requests"], result["completed"]) == (5, 5)


def test_tpot_is_the_time_after_the_first_token_per_later_token():
    # 257 tokens, the first at 1.0 s and the last at 2.28 s: 256 gaps of 5 ms
    assert load("common").tpot_ms(1.0, 2.28, 257) == pytest.approx(5.0)


def test_kernel_report_compares_moiras_configured_arms_with_moira():
    report = load("report")
    rows = [dict(shape="8k32", spread="cv0.0", arm="moira", us=60.0),
            dict(shape="8k32", spread="cv0.0", arm="moira_c12", us=66.0),
            dict(shape="8k32", spread="cv1.0", arm="moira", us=70.0),
            dict(shape="8k32", spread="cv1.0", arm="moira_c12", us=63.0),
            dict(shape="8k32", spread="cv1.0", arm="moira_hnd", us=50.0),
            dict(shape="8k32", spread=None, arm="moira_all_pages", us=250.0)]
    text = report.variant_table(dict(results=rows))
    assert text.splitlines()[0] == "| shape | spread | Moira | moira_c12 |"
    assert "| 8k x32 | cv0.0 | 60.0 | 66.0 (+10.0%) |" in text
    assert "| 8k x32 | cv1.0 | 70.0 | 63.0 (-10.0%) |" in text
    assert report.variant_table(dict(results=rows[:1])) == ""
    # an arm under Attend's options, also timed on every page (``<arm>_all_pages``)
    rows += [dict(shape="8k32", spread="cv0.0", arm="moira_ahead13", us=54.0),
             dict(shape="8k32", spread=None, arm="moira_ahead13_all_pages", us=225.0)]
    lines = report.variant_table(dict(results=rows)).splitlines()
    assert lines[0] == "| shape | spread | Moira | moira_ahead13 | moira_c12 |"
    assert "| 8k x32 | cv0.0 | 60.0 | 54.0 (-10.0%) | 66.0 (+10.0%) |" in lines
    assert "| 8k x32 | all pages | 250.0 | 225.0 (-10.0%) | — |" in lines
    assert "all pages" not in report.variant_table(dict(results=rows[:-2]))
    # shape names printed as tune_kernels prints them, the extra 16k32 too
    assert [report.shape_label(name) for name in ("8k32", "16k32", "131k4", "x")] == \
        ["8k x32", "16k x32", "131k x4", "x"]


def test_kernel_report_states_every_output_check():
    report = load("report")
    assert report.output_checks({}) == "Output checks: none in this run."
    checks = [dict(shape="8k32", spread="cv0.0", arm="fa3_varlen", max_abs_diff_to_moira=0.002,
                   agrees=True),
              dict(shape="8k32", spread="cv0.0", arm="moira_hnd", max_abs_diff_to_moira=0.0),
              dict(shape="8k32", spread="cv0.0", arm="flashinfer", max_abs_diff_to_moira=0.5,
                   agrees=False),
              dict(shape="131k4", spread="cv1.0", arm="flex", error="RuntimeError: no")]
    line = report.output_checks(dict(checks=checks))
    assert line.startswith("Output checks: 2 of 4 arm outputs match Moira's")
    assert "largest |difference| 0.002" in line
    assert "flashinfer 8k32 cv0.0 (0.5)" in line and "flex 131k4 cv1.0 (RuntimeError" in line


def test_vllm_compare_reads_runs_of_several_folders(tmp_path, capsys):
    compare = load("vllm_checks")

    def write(folder, name, tokens):
        folder.mkdir(exist_ok=True)
        run = dict(full=[dict(tokens=tokens, logprobs=[-1.0] * len(tokens))])
        (folder / f"{name}.json").write_text(json.dumps(run))

    earlier, later = tmp_path / "earlier", tmp_path / "later"
    write(earlier, "fcw1", [1, 2, 3])
    write(later, "plain", [1, 2, 3])
    write(later, "verbose_host2", [1, 5, 3])
    compare.main(["compare", str(later), str(earlier)])
    table = capsys.readouterr().out
    assert "| fcw1 vs the same command on another host and commit | 1/1 | - |" in table
    assert "| without vs with --jit-verbose, one host | 0/1 | 1 |" in table
    write(later, "fcw1", [1, 2, 3])  # the same name in both folders: refused, not overwritten
    with pytest.raises(SystemExit, match="'fcw1' is in two of the folders"):
        compare.main(["compare", str(later), str(earlier)])


def test_tpot_pairs_table_gives_an_engine_with_kernel_options_its_own_column(tmp_path):
    import json

    report = load("report")
    write_two_pairs(tmp_path, gamma=0.98, shape="130k4", reads=0.15)
    # the kern arm: kernel options in its JSON (older files: kernel_settings)
    for pair, tpot, given in ((1, 8.0, dict(kernels={"attend": "cuda"})),
                              (2, 6.0, dict(kernel_settings={"estimate.MAX_REGISTERS": 96}))):
        run = dict(backend="moira", model="llama-3.1-8b", gamma=0.98, **given,
                   results=[dict(shape="130k4", tpot_ms=tpot, imposed_read_fraction=0.15)])
        (tmp_path / f"pair{pair}" / "e.json").write_text(json.dumps(run))
    lines = report.pairs_table([report.tpot_load([str(tmp_path / f"pair{i}")])
                                for i in (1, 2)]).splitlines()
    assert "Moira, kernel options set" in lines[0]
    assert lines[2].endswith("| **2.50×** | 2.64× | 2.50× / 3.50× | **3.00×** |")


def test_vllm_engines_take_kernel_options_as_the_plugins_kernels_setting(capsys):
    from moira import KernelOptions
    from moira.integrations.vllm.settings import MoiraSettings

    common = load("common")
    # what an engine is given: only what differs from the defaults, as the plugin reads it
    options = KernelOptions.parse("attend=triton,attend.num_warps=8,select=cuda,fused=off")
    mapping = common.options_mapping(options)
    assert mapping == {"select": "cuda", "attend": "triton", "fused": "off",
                       "tuning": {"attend.num_warps": 8}}
    settings = MoiraSettings.from_sources({"moira": {"kernels": mapping}}, {})
    assert settings.kernels == options
    assert common.options_mapping(KernelOptions()) == {}
    # repeated --kernels join; their text form is checked before any engine starts
    parser = argparse.ArgumentParser()
    common.add_kernel_options(parser)
    args = parser.parse_args(["--kernels", "attend=triton", "--kernels", "attend.num_stages=3"])
    assert common.kernel_options(parser, args) == KernelOptions(
        attend="triton", tuning={"attend.num_stages": 3})
    tpot = load("vllm_tpot")
    for bad, message in (("attend.num_warps=8", "read only by the triton kernel"),
                         ("estimate.next_tile_ahead=1", "unknown tuning"),
                         ("select.shares_in_chunks_from=1024", "unknown tuning"),
                         ("attend=cutlass", "must be one of"),
                         ("estimate=triton,estimate.max_registers=many", "int in [24, 255]"),
                         ("merge.num_warps=4", "unknown tuning")):
        with pytest.raises(SystemExit):
            tpot.main(["--backend", "moira", "--kernels", bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpot.main(["--backend", "dense", "--kernels", "attend=cuda"])
    assert "dense engine runs FA3" in capsys.readouterr().err
    # --pairs: every arm known, and the kern arm has options to run
    with pytest.raises(SystemExit):
        tpot.main(["--pairs", "1", "--arms", "dense,moira,fboth"])
    assert "unknown ['fboth']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpot.main(["--pairs", "1", "--arms", "dense,kern"])
    assert "the kern arm runs the options of --kernels" in capsys.readouterr().err
    assert set(tpot.PAIR_ARMS) >= {"dense", "moira", "g099", "pdl", "split", "eq4", "t128",
                                   "jmin", "n1024", "jnocap", "nj16", "nofcw", "hnd", "kern"}


def test_tune_report_compares_each_variant_with_the_mean_of_the_default_runs():
    report = load("report")
    rows = [dict(kind="estimate", shape="8k x32", variant="default", us=10.0),
            dict(kind="estimate", shape="8k x32", variant="candidate", us=9.0),
            dict(kind="select", shape="8k x32", variant="candidate", us=99.0),
            dict(kind="estimate", shape="8k x32", variant="default again", us=12.0)]
    by_variant = report.tune_table(rows, "estimate")
    assert list(by_variant) == ["default", "candidate", "default again"]
    bases = report.baselines(by_variant)
    assert bases == {"": {"8k x32": 11.0}}
    assert "| candidate | 9.0 (-18%) |" in report.tune_markdown(by_variant, bases)
    with pytest.raises(SystemExit):
        report.baselines({"candidate": {"8k x32": 9.0}})
    # variants named by mode first (Select's): each mode against its own default
    select = {"coverage default": {"8k x32": 4.0}, "top22% default": {"8k x32": 8.0},
              "coverage warps=1": {"8k x32": 5.0}, "top22% warps=1": {"8k x32": 6.0},
              "coverage default again": {"8k x32": 6.0}}
    bases = report.baselines(select)
    assert bases == {"coverage": {"8k x32": 5.0}, "top22%": {"8k x32": 8.0}}
    text = report.tune_markdown(select, bases)
    assert "| coverage warps=1 | 5.0 (+0%) |" in text
    assert "| top22% warps=1 | 6.0 (-25%) |" in text
    # a sweep that names its own baseline (the Triton kernel against the CUDA one)
    step = {"step, triton": {"8k x32": 10.0}, "step, cuda select": {"8k x32": 12.0},
            "step, triton again": {"8k x32": 12.0}}
    bases = report.baselines(step, ["triton"])
    assert bases == {"step,": {"8k x32": 11.0}}
    assert "| step, cuda select | 12.0 (+9%) |" in report.tune_markdown(step, bases)
    # a case after the baseline's word (a wider table): that case's variants against it
    cases = {"cuda base": {"8k x32": 10.0}, "cuda idle exit": {"8k x32": 9.0},
             "cuda base, table 2048 pages": {"8k x32": 20.0},
             "cuda idle exit, table 2048 pages": {"8k x32": 15.0}}
    bases = report.baselines(cases, ["base"])
    assert bases == {"cuda": {"8k x32": 10.0}, "cuda …, table 2048 pages": {"8k x32": 20.0}}
    text = report.tune_markdown(cases, bases)
    assert "| cuda idle exit | 9.0 (-10%) |" in text
    assert "| cuda idle exit, table 2048 pages | 15.0 (-25%) |" in text


def test_step_profile_classes_name_the_cuda_kernels_and_edges_sum_the_waits_before_each():
    vllm_step_profile = load("vllm_step_profile")
    assert vllm_step_profile.kernel_class("moira_attend_d128_s2") == "Attend"
    assert vllm_step_profile.kernel_class("moira_estimate_d128_g4") == "Estimate"
    assert vllm_step_profile.kernel_class("moira_select_p8_w16_g4") == "Select"
    assert vllm_step_profile.kernel_class("_merge_kernel") == "Merge"
    layer = [("GEMM", 0.0, 10.0), ("Estimate", 12.0, 20.0), ("Select", 21.0, 30.0),
             ("Attend", 33.0, 80.0), ("Merge", 80.5, 84.0), ("GEMM", 90.0, 95.0)]
    gaps, chains = vllm_step_profile.edges(layer + [(k, a + 100, b + 100) for k, a, b in layer])
    assert gaps["Estimate"] == [2.0, 2.0] and gaps["GEMM"] == [6.0, 5.0, 6.0]
    assert gaps["Select"] == [1.0, 1.0]
    assert gaps["Attend"] == [3.0, 3.0] and gaps["Merge"] == [0.5, 0.5]
    assert chains == [72.0, 72.0]
    # a kernel overlapping the one before waits for nothing
    assert vllm_step_profile.edges([("GEMM", 0.0, 10.0), ("other", 5.0, 8.0),
                                    ("Merge", 9.0, 12.0)])[0] == {"other": [0.0], "Merge": [0.0]}


def test_summary_precision_forms_and_their_comparison():
    study = load("accuracy")
    generator = torch.Generator().manual_seed(3)
    summaries = torch.randn(6, 2, 2, 64, generator=generator) * 5
    summaries[:, :, 1] = summaries[:, :, 1].abs()  # variances are not negative
    scaled = study.FORMS["e4m3 scaled"](summaries)
    peak = summaries.abs().amax(dim=-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, and of the vector's peak
    assert ((scaled - summaries).abs() <= summaries.abs() / 16 + peak * 2**-9).all()
    assert not torch.equal(scaled, summaries)
    mixed = study.FORMS["var e4m3"](summaries)
    assert torch.equal(mixed[:, :, 0], summaries[:, :, 0].to(torch.bfloat16).float())
    assert torch.equal(mixed[:, :, 1], scaled[:, :, 1])

    # one decode step of a batch-1 row of 5 pages: every form selects, the bf16 one is returned
    batch, kv_heads, group, head_dim, pages = 1, 2, 2, 64, 5
    keys = torch.randn(pages, 64, kv_heads, head_dim, generator=generator)
    table = torch.arange(pages, dtype=torch.int32).view(1, pages)
    seq_lens = torch.tensor([pages * 64 - 10], dtype=torch.int32)
    query = torch.randn(batch, kv_heads * group, head_dim, generator=generator) * 3
    stats = {}
    select = study.comparing_select(0.98, stats)
    lists, counts = select(0, query, keys, table, seq_lens, head_dim ** -0.5)
    summaries = moira.reference.summarize(keys, table, seq_lens)
    expected = moira.reference.select(moira.reference.estimate(
        query, keys, study.FORMS["bf16"](summaries), table, seq_lens), seq_lens, gamma=0.98)
    assert torch.equal(lists, expected[0]) and torch.equal(counts, expected[1])
    assert set(stats) == set(study.FORMS)
    assert stats["bf16"]["rows"] == kv_heads and stats["bf16"]["identical"] == kv_heads
    assert stats["bf16"]["only_here"] == stats["bf16"]["only_base"] == 0
    assert 0 < stats["bf16"]["kept_mass"] <= kv_heads + 1e-5


def test_attend_timeline_rate_conserves_the_bytes_and_finds_ramp_and_tail():
    """``attend_timeline.analyse`` on made-up records: every listed byte lands in some bin
    (page 0 at its landing, the rest spread to the end), the span runs from the first start
    to the last end, a launch whose rate is flat in its middle has a ramp before it and a tail
    after it, and empty programs count as programs but not as working ones."""
    timeline = load("kernel_bench")
    page = timeline.PAGE_BYTES
    records = []
    for i in range(40):  # 40 programs of 30 pages, first page at 4 us, ends 60 .. 80 us
        start = 1_000 + 10 * i
        records.append([start, start + 4_000, start + 60_000 + 500 * i, 0, 0, 0, i % 8, 30])
    records.append([1_200, 0, 1_700, 0, 0, 0, 3, 0])  # an empty program
    summary = timeline.analyse(torch.tensor(records, dtype=torch.int64), rows=10)
    arrived = sum(summary["rate_tbps"]) * 1e6 * timeline.BIN_US
    assert math.isclose(arrived, 40 * 30 * page, rel_tol=1e-3)  # rounding of the rates only
    assert summary["programs"] == 41 and summary["working"] == 40
    assert summary["span_us"] == pytest.approx(79.89, abs=0.01)  # 0.39 + 60 + 19.5
    assert summary["ramp_us"] >= 4 and summary["tail_us"] > 5  # the ends spread over ~20 us
    assert summary["span_us"] > summary["ideal_us"]
    assert summary["prologue_median_us"] == pytest.approx(4.0)
    assert summary["empty_median_us"] == pytest.approx(0.5)


def test_attend_timeline_variants_name_chunk_stages_ceiling_and_table_width():
    timeline = load("kernel_bench")
    assert timeline.variant_settings("grid24") == (24, 2, None, None)
    assert timeline.variant_settings("grid32s3j4w2048") == (32, 3, 4, 2048)
    for bad in ("persistent24", "grid24r", "grid0", "grid24s5"):
        with pytest.raises(SystemExit, match="grid<C>"):
            timeline.variant_settings(bad)


def test_run_info_records_the_commit_and_a_hash_of_a_dirty_trees_diff(tmp_path, monkeypatch):
    """A result file names the code that made it: the commit, whether tracked files were
    changed and, if so, the SHA-256 of ``git diff HEAD`` (the same changes, the same hash; any
    other change, another); untracked files leave the tree clean."""
    import hashlib
    import subprocess

    common = load("common")

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "kernel.py").write_text("x = 1\n")
    git("add", "kernel.py")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "HEAD").strip()
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert common.git_state(str(tmp_path)) == (head, False, None)
    (tmp_path / "kernel.py").write_text("x = 2\n")
    commit, dirty, digest = common.git_state(str(tmp_path))
    assert (commit, dirty) == (head, True)
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=tmp_path,
                          capture_output=True).stdout
    assert digest == hashlib.sha256(diff).hexdigest()
    (tmp_path / "kernel.py").write_text("x = 3\n")
    assert common.git_state(str(tmp_path))[2] not in (None, digest)
    (tmp_path / "kernel.py").write_text("x = 2\n")
    assert common.git_state(str(tmp_path))[2] == digest
    git("add", "kernel.py")  # staged changes are changes against HEAD too
    assert common.git_state(str(tmp_path))[2] == digest
    assert common.git_state(str(tmp_path / "nowhere")) == (None, None, None)
    monkeypatch.setattr(common, "git_state", lambda: (head, True, digest))
    info = common.run_info()
    assert (info["commit"], info["dirty"], info["diff_sha256"]) == (head, True, digest)
