"""The accuracy harness on a tiny random-weight Llama built here (no downloads)."""

import copy
import math
import random

import pytest
import torch
from helpers import DEVICE

transformers = pytest.importorskip("transformers")

from moira.evaluation import experiments, hf, tasks  # noqa: E402


def encode(text):
    return list(text.encode("utf-8"))


def decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def text(words=6000, seed=0):
    rng = random.Random(seed)
    vocabulary = ["the", "a", "model", "reads", "pages", "of", "keys", "and", "values", "each",
                  "step", "attention", "mass", "is", "kept", "where", "it", "falls"]
    return " ".join(rng.choice(vocabulary) for _ in range(words)) + "."


@pytest.fixture(scope="module")
def lm():
    hf.register()
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=hf.ATTENTION_NAME, dtype=torch.float32)
    with torch.no_grad():  # peaked attention, so that gamma < 1 can skip pages
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
    return experiments.CausalLM(model.to(DEVICE))  # on the GPU host: `moira eval --device cuda`


def test_gamma_one_matches_dense_decoding(lm):
    ids = encode(text())[:300]
    kl_rows = experiments.token_kl(lm, [ids], [1.0, 0.3], new_tokens=6, progress=lambda m: None)
    exact, sparse = kl_rows
    assert exact["read_fraction"] == 1.0 and exact["kl"] < 1e-6
    assert sparse["read_fraction"] < 1.0 and sparse["kl"] > exact["kl"]


def test_prefill_is_the_models_own_attention(lm):
    ids = torch.tensor([encode(text())[:200]], device=lm.device)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(lm.model.config),
                                                          attn_implementation="eager")
    assert lm.model.config._attn_implementation == hf.ATTENTION_NAME
    eager.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        expected = eager.to(lm.device)(ids).logits
        actual = lm.model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_sparse_decode_step_is_the_reference(lm):
    ids = encode(text())[:200]
    cache, logprobs = lm.prefill(ids)
    sparse = hf.SparseDecoding(gamma=1.0)
    dense_step = lm.teacher_forced(cache, [int(logprobs.argmax())])[0]
    sparse_step = lm.teacher_forced(cache, [int(logprobs.argmax())], sparse)[0]
    torch.testing.assert_close(sparse_step, dense_step, rtol=1e-4, atol=1e-4)
    assert sparse.pages_total == 2 * 2 * math.ceil(201 / 64)  # layers x KV heads x pages


def test_multi_token_forward_on_a_cache_is_refused(lm):
    cache, _ = lm.prefill(encode(text())[:100])
    with pytest.raises(ValueError, match="empty cache"):
        lm.model(torch.tensor([[1, 2, 3]], device=lm.device), use_cache=True,
                 **{lm.cache_argument: cache})


def test_evaluate_end_to_end(lm):
    snapshots = []  # rows per task after each document: a cut-short run keeps them
    result = experiments.evaluate(
        lm.model, encode, decode, text(30000), context=640, documents=2, gammas=[0.5, 1.0],
        new_tokens=4, passage_tokens=24, progress=lambda m: None,
        checkpoint=lambda rows: snapshots.append({k: len(v) for k, v in rows.items()}))
    assert snapshots[0] == {"kl": 2} and snapshots[1] == {"kl": 4}  # 2 gammas per document
    assert snapshots[-1] == {k: len(v) for k, v in result["rows"].items()}
    table = result["table"]
    assert set(table) == {"dense", "0.5", "1.0"}
    assert table["1.0"]["kl"] < 1e-6 and table["1.0"]["kl_read_fraction"] == 1.0
    assert table["0.5"]["kl_read_fraction"] < 1.0
    assert table["1.0"]["retrieval"] == table["dense"]["retrieval"]
    assert table["1.0"]["retrieval_minus_dense"]["mean"] == 0.0
    assert abs(table["1.0"]["repeat_ppl"] - table["dense"]["repeat_ppl"]) < 1e-3
    assert len(result["rows"]["retrieval"]) == 2 * 2 * 3  # samples x kinds x (dense + gammas)
    printed = experiments.format_table(table).splitlines()  # what `moira eval` prints
    assert printed[0].split()[:3] == ["gamma", "token", "KL"] and "repeat ppl" in printed[0]
    assert [line.split()[0] for line in printed[2:]] == ["dense", "0.5", "1.0"]


def test_passkey_prompts():
    haystack = encode(text())
    single = tasks.passkey(haystack, encode, 500, kind="single", depth=0.5, seed=3)
    assert len(single.prompt) == 500 and single.answer.isdigit() and len(single.answer) == 5
    prompt = decode(single.prompt)
    assert prompt.count(single.answer) == 2 and prompt.endswith("The pass key is")
    assert prompt.startswith("A special pass key is hidden")
    assert abs(prompt.index(single.answer) / len(prompt) - 0.5) < 0.1
    multi = tasks.passkey(haystack, encode, 600, kind="multi", depth=0.1, seed=3)
    prompt = decode(multi.prompt)
    assert prompt.count(" The pass key for") == 4 + 1 and multi.answer in prompt  # + question
    with pytest.raises(ValueError, match="too short"):
        tasks.passkey(haystack, encode, 40)


def test_repeated_passage_and_windows():
    ids, second = tasks.repeated_passage([1, 2, 3], list(range(100, 200)), 20)
    assert len(ids) == 20 and ids[:3] == ids[second:] == [1, 2, 3]
    parts = tasks.windows(list(range(100)), 10, 5, seed=1)
    assert len({tuple(p) for p in parts}) == 5 and all(len(p) == 10 for p in parts)
    # too few disjoint windows: evenly spaced overlapping ones, first and last at the ends
    overlapping = sorted(tasks.windows(list(range(100)), 30, 4))
    assert [w[0] for w in overlapping] == [0, 23, 47, 70] and overlapping[-1][-1] == 99
    assert all(len(w) == 30 for w in overlapping)
    with pytest.raises(ValueError, match="fewer than one window"):
        tasks.windows(list(range(100)), 101, 1)
    with pytest.raises(ValueError, match="too few for 72 distinct windows"):
        tasks.windows(list(range(100)), 30, 72)


def test_paired_bootstrap():
    same = experiments.paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1])
    assert same == dict(mean=0.0, low=0.0, high=0.0)
    worse = experiments.paired_bootstrap([1] * 20, [0] * 5 + [1] * 15)
    assert worse["mean"] == -0.25 and worse["low"] < -0.25 < worse["high"] <= 0.0


def test_budget_analysis_and_ablation(lm):
    result = experiments.evaluate(
        lm.model, encode, decode, text(30000), context=400, documents=2, gammas=[0.9],
        tasks=("budget", "ablation"), new_tokens=4, calibration=1, progress=lambda m: None)
    budget = result["table"]["budget"]
    assert len(budget["coverage_fraction_per_layer_head"]) == 2  # layers
    assert 0 < budget["mean_coverage_fraction"] <= 1
    # a budget that covers 90% of the rows reads at least what the coverage sets read
    assert budget["fixed_budget_reads_vs_coverage"] >= budget["profiled_budget_reads_vs_coverage"]
    assert budget["profiled_budget_reads_vs_coverage"] >= 0.9
    ablation = result["table"]["ablation"]
    assert len(ablation) == 7 and all(0 < arm["read_fraction"] <= 1 for arm in ablation.values())
    error = result["table"]["estimator_error"]
    assert 0 < error["mean_exact_mass"] <= 1 + 1e-6 and len(error["worst_layer_heads"]) == 4
    printed = experiments.format_table(result["table"]).splitlines()
    header = next(i for i, line in enumerate(printed) if line.startswith("ablation arm"))
    arms = printed[header + 2:][:7]
    assert [line[:len(name)] for line, name in zip(arms, ablation)] == list(ablation)
    assert any(line.startswith("exact mass inside the gamma=0.98 lists") for line in printed)
    assert any(line.startswith("oracle coverage sets (") for line in printed)


def test_library_selectors_feed_attend():
    from moira import reference, selectors

    torch.manual_seed(0)
    keys = torch.randn(12, 64, 2, 64)
    values = torch.randn(12, 64, 2, 64)
    table = torch.randperm(12)[:10].view(2, 5).int()
    seq_lens = torch.tensor([64 * 4 + 3, 64 * 2], dtype=torch.int32)
    query = torch.randn(2, 4, 64)
    lists, counts = selectors.window(seq_lens, 2, 5, sink_pages=1, recent_pages=2)
    assert counts.tolist() == [[3, 3], [2, 2]]
    assert lists[0, 0, :3].tolist() == [0, 3, 4] and lists[1, 1, :2].tolist() == [0, 1]
    boxes = selectors.quest_summaries(keys, table, seq_lens)
    lists, counts = selectors.quest(query, boxes, table, seq_lens, top_k=3)
    assert counts.tolist() == [[3, 3], [2, 2]]
    assert (lists[0, :, 0] == 0).all() and (lists[0, :, 2] == 4).all()
    # the bound is an upper bound of every key's logit in the page
    for h in range(2):
        page = int(table[0, 1])
        logits = query[0, 2 * h : 2 * h + 2] @ keys[page, :, h].T
        lo, hi = boxes[page, h, 0], boxes[page, h, 1]
        bound = torch.maximum(query[0, 2 * h : 2 * h + 2] * lo, query[0, 2 * h : 2 * h + 2] * hi)
        assert (logits.amax(-1) <= bound.sum(-1) + 1e-4).all()
    out = reference.attend(query, keys, values, table, seq_lens, lists, counts)
    assert torch.isfinite(out).all()


def test_calibration_measures_each_heads_tail(lm, tmp_path):
    from moira.evaluation import calibration

    covered = calibration.measure(lm, [encode(text())[:400]], gamma=0.5, new_tokens=3,
                                  progress=lambda m: None)
    assert len(covered) == 2 and all(len(row) == 2 for row in covered)  # layers x KV heads
    assert all(0 < m <= 1 + 1e-6 for row in covered for m in row)  # exact mass: may miss 0.5
    ratios = [[calibration.tail_ratio(m, 0.5) for m in row] for row in covered]
    targets = calibration.targets(ratios, 0.5)
    assert targets.shape == (2, 2) and targets.dtype == torch.float32
    # a head that leaves out twice the mass it meant to is asked for half the tail
    assert calibration.targets([[2.0]], 0.98).item() == pytest.approx(0.99)
    assert calibration.tail_ratio(1.0, 0.98) == calibration.MIN_RATIO  # keeps all: clamped
    assert (calibration.targets(ratios, 1.0) == 1.0).all()
    path = tmp_path / "cal.json"
    path.write_text('{"tail_ratios": [[1.0, 2.0], [0.5, 3.0]]}')
    assert calibration.load(str(path), 2, 2) == [[1.0, 2.0], [0.5, 3.0]]
    with pytest.raises(ValueError, match="2 layers x 2 KV heads, this model has 3 x 2"):
        calibration.load(str(path), 3, 2)
    path.write_text('{"gamma": 0.98}')
    with pytest.raises(ValueError, match="not a `moira calibrate` result"):
        calibration.load(str(path))
    for table in ("[[1.0, 1.0], [1.0]]", '[[1.0, "x"]]', "[]", "[1.0, 2.0]"):  # ragged, ...
        path.write_text(f'{{"tail_ratios": {table}}}')
        with pytest.raises(ValueError, match="table of numbers"):
            calibration.load(str(path))


def test_calibrated_arms_use_per_head_targets(lm):
    docs = [encode(text(seed=3))[:400]]
    quiet = dict(progress=lambda m: None)
    # tail ratio 1 everywhere: the targets are gamma itself, so the arm equals gamma's
    neutral = experiments.Calibrated(0.5, ((0.5, 0.5), (0.5, 0.5)))
    rows = experiments.token_kl(lm, docs, [0.5, neutral], new_tokens=4, **quiet)
    assert [r["gamma"] for r in rows] == [0.5, "0.5 calibrated"]
    assert rows[0]["kl"] == rows[1]["kl"] and rows[0]["read_fraction"] == rows[1]["read_fraction"]
    # a head asked for more mass reads more
    stricter = experiments.Calibrated(0.5, ((0.5, 0.99), (0.5, 0.99)))
    rows = experiments.token_kl(lm, docs, [0.5, stricter], new_tokens=4, **quiet)
    assert rows[1]["read_fraction"] > rows[0]["read_fraction"]
    table = experiments.summarize_rows({"kl": rows})
    assert set(table) == {"0.5", "0.5 calibrated"}
    result = experiments.evaluate(lm.model, encode, decode, text(8000), context=300,
                                  documents=1, gammas=[0.5, 1.0], tasks=("kl",), new_tokens=3,
                                  tail_ratios=[[1.0, 2.0], [1.0, 1.0]], **quiet)
    assert set(result["table"]) == {"0.5", "1.0", "0.5 calibrated"}  # none for gamma = 1
    measured = experiments.evaluate(lm.model, encode, decode, text(8000), context=300,
                                    documents=1, gammas=[0.5], tasks=("kl",), new_tokens=3,
                                    calibrate_documents=1, **quiet)
    assert set(measured["table"]) == {"0.5", "0.5 calibrated"}
    assert len(measured["rows"]["calibration"]) == 2  # mean covered per layer


def test_needle_tasks_build_deterministic_prompts():
    prose = encode(text(words=3000))
    code = encode(tasks.code_haystack(400, seed=1))
    assert tasks.code_haystack(50, seed=1) == tasks.code_haystack(50, seed=1)
    assert tasks.code_haystack(50, seed=1) != tasks.code_haystack(50, seed=2)
    assert "def " in tasks.code_haystack(50, seed=1)
    for task in tasks.NEEDLE_TASKS:
        haystack = code if task.startswith("code-") else prose
        sample = tasks.needle_task(task, haystack, encode, 2000, depth=0.3, seed=4)
        again = tasks.needle_task(task, haystack, encode, 2000, depth=0.3, seed=4)
        other = tasks.needle_task(task, haystack, encode, 2000, depth=0.3, seed=5)
        assert sample == again and sample.prompt != other.prompt
        assert len(sample.prompt) == 2000 and sample.task == task
        assert sample.needle_tokens < 64  # every needle shorter than a page
        prompt = decode(sample.prompt)
        for answer in sample.answers:
            assert answer in prompt  # the answer is planted in the haystack
        if task == "vartrack":  # the chain's head holds the value, the question its tail
            assert f"= {sample.answers[0]}." in prompt and prompt.endswith("=")
    with pytest.raises(ValueError, match="task must be"):
        tasks.needle_task("nope", prose, encode, 2000)
    with pytest.raises(ValueError, match="too short"):
        tasks.needle_task("fact", prose[:100], encode, 2000)


def test_needle_depth_and_answer_checks():
    prose = encode(text(words=3000))
    for depth in (0.1, 0.9):
        sample = tasks.needle_task("fact", prose, encode, 2000, depth=depth, seed=1)
        at = decode(sample.prompt).index(sample.answers[0]) / 2000
        assert abs(at - depth) < 0.1
    assert tasks.check_answer(" 12345.", ("12345",))
    assert not tasks.check_answer(" 1234", ("12345",))
    assert tasks.check_answer(" 111 and 222", ("222", "111"))
    assert not tasks.check_answer(" 111 and 2", ("222", "111"))
    assert tasks.may_still_answer(" 123", ("12345",))
    assert not tasks.may_still_answer(" 124", ("12345",))


def test_estimator_study_on_a_tiny_model(lm):
    from moira.evaluation import estimator_study

    prose = encode(text(words=3000))
    sample = tasks.needle_task("fact", prose, encode, 400, depth=0.5, seed=1)
    names = ["exact", "mvar", "int4"]
    arms = [("exact", "fraction", 0.5), ("mvar", "gamma", 0.9)]
    row = estimator_study.run_sample(lm, sample, decode, names, arms, max_new_tokens=3)
    assert 1 <= row["steps"] <= 3 and set(row["stats"]) == set(names)
    exact = row["stats"]["exact"]
    assert exact["rows"] == row["steps"] * 2 * 2  # steps x layers x KV heads
    for name in names:  # no estimator keeps more exact mass than the exact masses do
        assert row["stats"][name]["covered_at_fraction"][0] <= exact["covered_at_fraction"][0] \
            + 1e-6
    table = estimator_study.summarize([row, dict(row, task="other")])
    assert table["all"]["samples"] == 2 and set(table) == {"fact", "other", "all"}
    arm = table["fact"]["arms"]["exact @ read 0.5"]
    assert 0 < arm["read_fraction"] <= 1 and arm["kl"] >= 0


def test_evaluate_with_the_codes_beside_mvar(lm):
    """``estimators=("int2",)`` adds a "<gamma> int2" arm for every gamma below 1."""
    result = experiments.evaluate(
        lm.model, encode, decode, text(30000), context=640, documents=1, gammas=[0.5, 1.0],
        tasks=("kl",), new_tokens=4, progress=lambda m: None, estimators=("int2",))
    table = result["table"]
    assert set(table) == {"0.5", "0.5 int2", "1.0"}
    assert 0 < table["0.5 int2"]["kl_read_fraction"] < 1.0
    assert "0.5 int2" in experiments.format_table(table)
