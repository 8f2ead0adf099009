"""launch/build_head_accelerator.py end to end on a tiny target (real tokenizer, random
weights): every phase runs inside its time box, an earlier regeneration is kept, the training
schedule is sized by the calibration run and reached, and the exported head loads."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tiny_gguf import write_tiny_gguf
from xla_flags import child_env

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "build_head_accelerator.py"


def _prompts(path: Path, n: int) -> Path:
    words = "plan a trip explain gravity write a poem list colours name rivers".split()
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(words[j % len(words)] for j in range(2 + i))  # longer each time
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"role": "user", "content": text}, {"role": "assistant", "content": "x"}]}) + "\n")
    return path


def test_build_runs_every_phase_in_its_budget(smollm2_gguf_path, tmp_path):
    from eagle3_jax.draft.load import load_head

    target = write_tiny_gguf(smollm2_gguf_path, tmp_path / "tiny.gguf")
    prompts = _prompts(tmp_path / "prompts.jsonl", 40)
    # An earlier regeneration of one conversation: kept, not answered again.
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    kept = {"id": "c0", "conversations": [{"role": "user", "content": "plan a trip"},
                                          {"role": "assistant", "content": "Kept answer."}]}
    (earlier / "regenerated-00000.jsonl").write_text(json.dumps(kept) + "\n")
    # The regeneration box is sized for a loaded 2-core machine (beside another test worker):
    # at 40 s of a 100 s budget, one CI run answered only the kept conversation of 30 in time.
    out, budget = tmp_path / "out", 100
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", str(target), "--prompts", str(prompts),
         "--out", str(out), "--work", str(tmp_path / "work"), "--regen-dir", str(earlier),
         "--budget-s", str(budget), "--regen-s", "60", "--export-s", "10", "--slots", "8",
         "--max-new-tokens", "12", "--conversations", "16", "--draft-vocab-size", "256",
         "--batch-size", "2", "--max-len", "128", "--ttt-steps", "2", "--calibrate-steps", "12"],
        capture_output=True, text=True, timeout=budget + 120,
        env=child_env(devices=None))  # one CPU device
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((out / "build.json").read_text())
    # 16 greedy answers (one of them the kept one) and 16 sampled ones, trained on together.
    assert info["conversations_t0"] == 16 and info["conversations"] == 16 + info["conversations_t1"]
    import lzma
    rows = [json.loads(line) for line in lzma.open(out / "regenerated.jsonl.xz", "rt")]
    assert {"c0", "c15"} <= {r["id"] for r in rows} and "c16" not in {r["id"] for r in rows}
    assert next(r for r in rows if r["id"] == "c0")["conversations"][-1]["content"] == "Kept answer."
    train = info["train"]
    assert train["total_steps"] > 8 and train["end_step"] == train["total_steps"]
    # Every phase inside the budget (a little slack for the process start-up and the end).
    assert info["phases"]["total_s"] <= budget + 15
    head = load_head(out / "head")
    assert head.head.cfg.hidden_size == 32
    assert np.all(np.isfinite(np.asarray(head.head.params["fc"], np.float32)))


def test_calibration_separates_the_step_time_from_the_eval_and_checkpoint():
    """Compilation (first steps) and the eval + save after step k/2 are not steps: a sized run
    that took either for step time would overshoot its budget (one CI run did, by 30 steps)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("build_head_accelerator", SCRIPT)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    k, step, event = 12, 0.02, 0.7
    seconds, recs = 3.0, []                               # step 1 ends after compiling
    for s in range(1, k + 1):
        seconds += (1.0 if s == 2 else 0.0) + (event if s == k // 2 + 1 else 0.0) + step
        recs.append({"step": s, "seconds": round(seconds + (0.001 if s % 3 == 0 else 0), 3)})
    step_s, event_s = build.step_and_event_seconds(recs, k)
    assert abs(step_s - step) < 2e-3 and abs(event_s - event) < 3e-3
