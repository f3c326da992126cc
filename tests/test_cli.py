import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from moira import cli


def test_demo_in_process(tmp_path, capsys):
    png = tmp_path / "kept.png"
    cli.main(["demo", "--context", "1000", "--batch", "2", "--kv-heads", "2", "--group", "3",
              "--out", str(png)])
    printed = capsys.readouterr().out
    assert "retrieval" in printed and "pages read:" in printed
    rows = [line for line in printed.splitlines() if "sink+local" in line or "retrieval" in line]
    assert len(rows) == 4  # 2 requests x 2 KV heads
    assert png.stat().st_size > 10_000


def test_demo_console_entry_picks_the_interpreter_itself(tmp_path):
    # a fresh process without TRITON_INTERPRET, as a user would run it on a CPU machine
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if "CUDA_VISIBLE_DEVICES" not in env and sys.platform == "linux":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "-m", "moira.cli", "demo", "--context", "700", "--kv-heads", "1",
         "--device", "cpu", "--out", str(tmp_path / "demo.png")],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Triton CPU interpreter" in result.stdout and "pages read:" in result.stdout


def test_demo_without_matplotlib_skips_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    png = tmp_path / "kept.png"
    assert cli.main(["demo", "--context", "300", "--kv-heads", "1", "--out", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "pages read:" in printed and not png.exists()
    notes = [line for line in printed.splitlines() if "matplotlib" in line]
    assert len(notes) == 1 and "skipped the plot" in notes[0] and "[demo]" in notes[0]


# --------------------------------------------------------------------------------------------
# Help text and bad values
# --------------------------------------------------------------------------------------------


def test_help_lists_every_option_with_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # no wrapping inside "(default: ...)"
    _, commands = cli.build_parser()
    assert set(commands) == {"demo", "eval", "calibrate"}
    for name, command in commands.items():
        with pytest.raises(SystemExit) as stop:
            cli.main([name, "--help"])
        assert stop.value.code == 0
        shown = " ".join(capsys.readouterr().out.split())
        for action in command._actions:
            if action.dest == "help":
                continue
            option = action.option_strings[0]
            assert action.help, f"moira {name} {option} has no help text"
            assert option in shown
            if action.required or action.default is None:
                assert f"{option} " in shown
            else:
                assert f"(default: {action.default})" in shown, f"moira {name} {option}"
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.98)" in shown and "(default: moira-demo.png)" in shown


@pytest.fixture
def inputs(tmp_path):
    """A model folder (only its config.json: enough for the checks, which run first) and
    text files."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "text.txt").write_text("some long text " * 100)
    (tmp_path / "no-text.json").write_text('{"body": "..."}')
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bad-calibration.json").write_text('{"tail_ratios": [[1.0], [1.0, 2.0]]}')
    (tmp_path / "weights.bin").write_text("")
    return tmp_path


DEMO_BAD = [
    (["--context", "0"], "--context", ">= 1"),
    (["--context", "2.5"], "--context", "whole number"),
    (["--batch", "0"], "--batch", ">= 1"),
    (["--batch", "-3"], "--batch", ">= 1"),
    (["--kv-heads", "0"], "--kv-heads", ">= 1"),
    (["--group", "0"], "--group", ">= 1"),
    (["--head-dim", "32"], "--head-dim", "choose from 64, 128"),
    (["--gamma", "1.5"], "--gamma", "0 < gamma <= 1"),
    (["--gamma", "0"], "--gamma", "0 < gamma <= 1"),
    (["--gamma", "-0.5"], "--gamma", "0 < gamma <= 1"),
    (["--gamma", "nan"], "--gamma", "finite number"),
    (["--gamma", "high"], "--gamma", "expected a number"),
    (["--seed", "-1"], "--seed", "from 0 to"),
    (["--device", "tpu"], "--device", "choose from"),
    (["--out", "{tmp}/missing/kept.png"], "--out", "does not exist"),
    (["--out", "{tmp}"], "--out", "is a folder"),
    (["--out", "{tmp}/kept.txt"], "--out", "end it in .png"),
]
MODEL_BAD = [  # eval and calibrate alike
    (["--model", "{tmp}/missing"], "--model", "does not exist"),
    (["--model", "{tmp}/missing.gguf"], "--model", "does not exist"),
    (["--model", "{tmp}/weights.bin"], "--model", "is not a .gguf file"),
    (["--model", "{tmp}"], "--model", "has no config.json"),
    (["--text", "{tmp}/missing.txt"], "--text", "does not exist"),
    (["--text", "{tmp}"], "--text", "is a folder"),
    (["--text", "{tmp}/no-text.json"], "--text", 'holds no "text" string'),
    (["--text", "{tmp}/empty.txt"], "--text", "holds no text"),
    (["--context", "0"], "--context", ">= 1"),
    (["--documents", "0"], "--documents", ">= 1"),
    (["--new-tokens", "1"], "--new-tokens", ">= 2"),
    (["--seed", "x"], "--seed", "whole number"),
    (["--device", "gpu"], "--device", "choose from"),
    (["--out", "{tmp}/missing/result.json"], "--out", "does not exist"),
]
EVAL_BAD = MODEL_BAD + [
    (["--gammas", "0.9,1.5"], "--gammas", "0 < gamma <= 1"),
    (["--gammas", "0"], "--gammas", "0 < gamma <= 1"),
    (["--gammas", "0.9,,1"], "--gammas", "comma-separated numbers"),
    (["--gammas", ""], "--gammas", "comma-separated numbers"),
    (["--gammas", "0.9,0.9"], "--gammas", "twice"),
    (["--tasks", "kl,perplexity"], "--tasks", "unknown task 'perplexity'"),
    (["--tasks", "kl,kl"], "--tasks", "twice"),
    (["--calibration", "0"], "--calibration", ">= 1"),
    (["--calibrate", "-1"], "--calibrate", ">= 0"),
    (["--calibrated", "{tmp}/missing.json"], "--calibrated", "does not exist"),
    (["--calibrated", "{tmp}/bad-calibration.json"], "--calibrated", "table of numbers"),
    (["--calibrated", "{tmp}/bad-calibration.json", "--calibrate", "2"], "--calibrate",
     "not allowed with argument --calibrated"),
]
CALIBRATE_BAD = MODEL_BAD + [
    (["--gamma", "1"], "--gamma", "0 < gamma < 1"),
    (["--gamma", "0"], "--gamma", "0 < gamma < 1"),
    (["--gamma", "1.5"], "--gamma", "0 < gamma < 1"),
]
BAD = ([("demo", *case) for case in DEMO_BAD] + [("eval", *case) for case in EVAL_BAD]
       + [("calibrate", *case) for case in CALIBRATE_BAD])


@pytest.mark.parametrize("command, bad, option, fix", BAD,
                         ids=[f"{c[0]} {' '.join(c[1])}".replace("{tmp}", "") for c in BAD])
def test_a_bad_value_names_its_option(command, bad, option, fix, inputs, capsys):
    argv = [command] + [arg.replace("{tmp}", str(inputs)) for arg in bad]
    if command != "demo":  # the required options, valid, after the bad one
        given = set(bad)
        argv += [arg for flag, value in (("--model", inputs / "model"),
                                         ("--text", inputs / "text.txt"))
                 if flag not in given for arg in (flag, str(value))]
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"moira {command}: error: argument {option}: "), last
    assert fix in last, last


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["demo", "eval", "calibrate"])
def test_device_cuda_without_a_gpu(command, inputs, capsys):
    argv = [command, "--device", "cuda"]
    if command != "demo":
        argv += ["--model", str(inputs / "model"), "--text", str(inputs / "text.txt")]
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"moira {command}: error: argument --device: torch sees no CUDA device: "
                    f"use --device cpu (or auto)")


def test_bad_value_from_the_console_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moira.cli", "demo", "--gamma", "1.5"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "moira demo: error: argument --gamma: 1.5 is not in (0, 1]: give a share of the "
        "attention mass, 0 < gamma <= 1, e.g. 0.98 (1 keeps every page)")


def _length_args(command, **values):
    defaults = dict(context=100, documents=2, tasks=["kl"], calibration=5, calibrate=0)
    return argparse.Namespace(command=command, **dict(defaults, **values))


def _fails(args, ids):
    def fail(message):
        raise SystemExit(message)

    def encode(text):
        return list(text.encode())

    try:
        cli._check_text_length(args, ids, encode, fail)
    except SystemExit as stop:
        return str(stop)
    return None


def test_context_is_checked_against_the_text():
    ids = list(range(1000))
    # eval: each third (333 tokens) must hold --documents distinct windows of --context
    assert _fails(_length_args("eval", context=332, documents=2), ids) is None
    message = _fails(_length_args("eval", context=333, documents=2), ids)
    assert message.startswith("argument --context: the text holds 1000 tokens (333 per third)")
    assert "give --context 332 or less, or a longer --text" in message
    assert "give a longer --text" in _fails(_length_args("eval", documents=400), ids)
    assert _fails(_length_args("eval", tasks=["ablation"], calibration=300), ids)
    assert _fails(_length_args("eval", calibrate=300), ids)
    # the repeated passage needs two copies, the pass-key prompts their preamble and question
    assert "--context 192 or more" in _fails(_length_args("eval", tasks=["repeat"]), ids)
    assert _fails(_length_args("eval", context=200, tasks=["repeat"]), ids) is None
    assert "pass-key prompts" in _fails(_length_args("eval", context=40,
                                                     tasks=["retrieval"]), ids)
    assert _fails(_length_args("eval", context=600, tasks=["retrieval"]), ids * 3) is None
    # calibrate: --documents windows from the whole text
    assert _fails(_length_args("calibrate", context=999, documents=2), ids) is None
    assert "give --context 999 or less" in _fails(_length_args("calibrate", context=1000), ids)


def test_eval_prints_a_table_and_writes_json_only_to_out(inputs, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from moira.evaluation import experiments

    table = {"dense": {"retrieval": 0.9, "repeat_ppl": 12.5},
             "0.98": {"kl": 0.0123, "kl_read_fraction": 0.41, "retrieval": 0.85,
                      "retrieval_minus_dense": dict(mean=-0.05, low=-0.15, high=0.0),
                      "retrieval_read_fraction": 0.38, "repeat_ppl": 12.6,
                      "repeat_read_fraction": 0.4},
             "1.0": {"kl": 0.0, "kl_read_fraction": 1.0}}
    calls = []
    monkeypatch.setattr(cli, "_model_and_text",
                        lambda args, fail: (None, None, "cpu", args.text_content))
    monkeypatch.setattr(experiments, "evaluate", lambda *a, **k: calls.append(k) or dict(
        rows={"kl": []}, table=table, overlapping_windows=False, seconds=1.0))
    out = inputs / "accuracy.json"
    assert cli.main(["eval", "--model", str(inputs / "model"), "--text",
                     str(inputs / "text.txt"), "--gammas", "0.98,1", "--tasks", "kl,retrieval",
                     "--out", str(out)]) == 0
    assert calls[0]["gammas"] == [0.98, 1.0] and calls[0]["tasks"] == ["kl", "retrieval"]
    printed = capsys.readouterr().out
    assert "{" not in printed  # no JSON on stdout
    lines = printed.splitlines()
    header = next(line for line in lines if line.startswith("gamma"))
    assert "token KL" in header and "retrieval" in header and "repeat ppl" in header
    assert [line.split()[0] for line in lines[lines.index(header) + 2:][:3]] == [
        "dense", "0.98", "1.0"]
    assert any("0.0123" in line and "41.0%" in line and "-0.050 [-0.150, +0.000]" in line
               for line in lines)
    assert lines[-1] == f"wrote {out}"
    result = json.loads(out.read_text())
    assert result["table"] == table and result["gammas"] == [0.98, 1.0]
    assert not (inputs / "accuracy.json.partial").exists()
