import os
import subprocess
import sys

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
