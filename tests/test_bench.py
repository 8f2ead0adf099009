"""The benchmark commands run end to end on the default model and write what they promise
(short settings: these check the plumbing, the numbers live in docs/BENCHMARKS.md)."""

import json

from eagle3_jax.bench.__main__ import main


def test_bench_forward_writes_curve_and_floor(smollm2_gguf_path, tmp_path):
    out, png = tmp_path / "forward.json", tmp_path / "forward.png"
    assert main(["forward", "--skip-hf", "--sizes", "1,4", "--repeats", "1", "--context", "32",
                 "--out", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert set(result["forward_ms"]) == {"1", "4"} and result["decode_floor_ms"] > 0
    assert result["decode_loop_ms_per_token"] > 0
    assert result["param_bytes"] > 500e6 and png.stat().st_size > 0


def test_bench_train_reports_throughput_and_memory(smollm2_gguf_path, tmp_path):
    out = tmp_path / "train.json"
    assert main(["train", "--batch-size", "1", "--max-len", "32", "--ttt-steps", "2",
                 "--draft-vocab-size", "1024", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens_per_s"] > 0 and result["peak_rss_mib"] > 0
    assert result["xla_memory"]["argument_mib"] > 500  # the SmolLM2 target is an argument


def test_unknown_command_is_refused(capsys):
    assert main(["nope"]) == 2
    assert "usage" in capsys.readouterr().err
