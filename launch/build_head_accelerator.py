"""Regenerate data and train an EAGLE-3 head on one accelerator inside a fixed time budget.

`launch/build_default_head.sh` (`make head`) builds the shipped head on a CPU over hours; this is
the same recipe for a lent GPU (or a TPU VM) with minutes: every phase is time-boxed, keeps
whatever it finished, and the training schedule is sized to the time that is left, so the
learning rate has decayed when the budget ends.

    python launch/build_head_accelerator.py --target MODEL.gguf --prompts PROMPTS.jsonl \\
        --out OUT [--regen-dir DIR] [--init-head builtin:smollm2-135m] [--budget-s 540]

Phases:
  1. regenerate  the first user turn of every prompt conversation, answered greedily by the
                 target (`data regenerate`: continuous batching over --slots rows, prompts in
                 order of length, resumable; --regen-dir's finished answers are kept and not
                 redone), then once more sampled at --sample-temperature, all stopped at
                 --regen-s; the finished conversations of both are trained on
  2. tokens      `data vocab --tokens-out` over them (the draft vocabulary is the initial
                 head's, or built here when there is none)
  3. train       a calibration run of --calibrate-steps measures the step time and the cost
                 of an eval with its checkpoint; the run then resumes with total_steps sized to
                 what is left of --budget-s (cosine decay to the end, steps planned 8% slower
                 than measured), checkpointing as it goes
  4. export      the head in the released layout (bfloat16) with metrics into OUT

Output (OUT): head/{config.json, model.safetensors}, metrics.jsonl, accuracy.png,
build.json (phase times, conversations, tokens, tokens/s, steps) and regenerated.jsonl.xz (the
conversations trained on, to continue elsewhere). The run folder and data stay under --work.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:7.1f}s] {msg}", flush=True)


def run(cmd: list[str], *, seconds: float | None = None, env: dict | None = None) -> bool:
    """Run ``cmd`` (output to ours); stop it (SIGTERM, then KILL) after ``seconds``.
    Returns True when it exited 0."""
    log("$ " + " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)
    try:
        rc = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        log(f"time box of {seconds:.0f} s reached: stopping it")
        proc.terminate()
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    log(f"exit {rc}")
    return rc == 0


EVALS = 8           # evaluations in the sized run (a checkpoint at every other one)
STEP_MARGIN = 1.08  # steps are planned this much slower than calibrated (a busy host varies)


def step_and_event_seconds(recs: list[dict], k: int) -> tuple[float, float]:
    """From a calibration run logging every step and evaluating + saving after step k/2 and k:
    (seconds per training step, seconds of one eval with its plot and checkpoint).

    The step time is the median interval between consecutive steps, leaving out the first two
    (compilation) and the one after k/2 (the eval and save); the event cost is that interval
    less one step."""
    secs = {r["step"]: r["seconds"] for r in recs}
    gaps = [secs[s] - secs[s - 1] for s in range(3, k + 1) if s != k // 2 + 1 and s - 1 in secs]
    step_s = max(float(np.median(gaps)), 1e-4)
    event_s = max(secs[k // 2 + 1] - secs[k // 2] - step_s, 0.0)
    return step_s, event_s


def train_records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines())
            if r.get("kind") == "train"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target: preset, .gguf or HF folder")
    p.add_argument("--prompts", required=True,
                   help="`data prepare` folder or conversations .jsonl (first user turns used)")
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--work", default="/tmp/eagle3-build", help="data and run folder")
    p.add_argument("--regen-dir", default=None, help="shards of an earlier regenerate to keep")
    p.add_argument("--init-head", default=None, help="start from this head (builtin:NAME, folder)")
    p.add_argument("--budget-s", type=float, default=540, help="whole build, seconds")
    p.add_argument("--regen-s", type=float, default=170, help="regeneration time box, seconds")
    p.add_argument("--export-s", type=float, default=45, help="kept for the export, seconds")
    p.add_argument("--slots", type=int, default=256, help="rows regenerated together")
    p.add_argument("--sample-temperature", type=float, default=1.0,
                   help="then answer the prompts once more by sampling at this temperature "
                        "(0: greedy answers only)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--calibrate-steps", type=int, default=30)
    p.add_argument("--steps", type=int, default=None,
                   help="train to exactly this many steps (default: as many as the budget "
                        "allows, measured by the calibration run)")
    p.add_argument("--conversations", type=int, default=None,
                   help="answer only the N prompts with the shortest openings (default all)")
    p.add_argument("--config", default="train-smollm2-135m",
                   help="the training config the run starts from (the flags below override it)")
    p.add_argument("--train", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further train-config overrides")
    args = p.parse_args(argv)
    deadline = START + args.budget_s
    py = sys.executable
    work, out = Path(args.work), Path(args.out)
    regen, run_dir = work / "regen", work / "run"
    for d in (work, out, regen):
        d.mkdir(parents=True, exist_ok=True)
    info: dict = {"command": " ".join(sys.argv), "args": vars(args), "phases": {}}
    env = dict(os.environ)
    if args.regen_dir:
        for f in Path(args.regen_dir).glob("*.jsonl"):
            if not (regen / f.name).exists():
                shutil.copy(f, regen / f.name)

    def save_info() -> None:
        (out / "build.json").write_text(json.dumps(info, indent=1))

    # 1. regenerate ------------------------------------------------------------------------
    t0 = time.monotonic()
    regen_end = min(START + args.regen_s, deadline - args.export_s - 60)
    # Greedy answers as the target gives them: full float32 matmuls (no TF32 on GPUs).
    regen_env = dict(env, JAX_DEFAULT_MATMUL_PRECISION="highest")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from eagle3_jax.data.regenerate import load_conversations, merge_shards
    n_prompts = len(load_conversations(args.prompts))
    n_prompts = min(n_prompts, args.conversations or n_prompts)
    passes = [(regen, args.prompts, 0.0)]
    if args.sample_temperature > 0:
        # The same prompts once more, answered by sampling (ids suffixed, so both are kept).
        sampled = work / "prompts_sampled.jsonl"
        with open(sampled, "w", encoding="utf-8") as dst:
            for r in load_conversations(args.prompts):
                r = dict(r, id=f"{r['id']}~t{args.sample_temperature:g}")
                dst.write(json.dumps(r) + "\n")
        passes.append((work / "regen_sampled", str(sampled), args.sample_temperature))
    lines: list[str] = []
    for folder, prompts, temperature in passes:
        folder.mkdir(parents=True, exist_ok=True)
        if regen_end - time.monotonic() > 10:
            run([py, "-m", "eagle3_jax.data", "regenerate", "--data", prompts, "--out",
                 str(folder), "--target", args.target, "--max-turns", "1", "--max-new-tokens",
                 str(args.max_new_tokens), "--max-prompt-len", str(args.max_prompt_len),
                 "--batch-size", str(args.slots), "--shortest", str(n_prompts),
                 "--temperature", str(temperature), "--seed", "1"],
                seconds=regen_end - time.monotonic(), env=regen_env)
        new = [ln for ln in merge_shards(folder).read_text(encoding="utf-8").split("\n") if ln]
        info[f"conversations_t{temperature:g}"] = len(new)
        lines += new
    merged = work / "conversations.jsonl"
    merged.write_text("\n".join(lines) + "\n", encoding="utf-8")
    info["phases"]["regenerate_s"] = round(time.monotonic() - t0, 1)
    info["conversations"] = len(lines)
    with lzma.open(out / "regenerated.jsonl.xz", "wt", encoding="utf-8", preset=3) as f:
        f.write("\n".join(lines) + "\n")
    log(f"{len(lines)} conversations regenerated in all")
    save_info()

    # 2. tokens ----------------------------------------------------------------------------
    t0 = time.monotonic()
    tokens, vocab = work / "tokens.npz", work / "draft_vocab.npz"
    if not run([py, "-m", "eagle3_jax.data", "vocab", "--data", str(merged), "--target",
                args.target, "--draft-vocab-size", str(args.draft_vocab_size), "--max-len",
                str(args.max_len), "--out", str(vocab), "--tokens-out", str(tokens)], env=env):
        return 1
    tok = np.load(tokens)
    info["tokens"] = int(len(tok["tokens"]))
    info["assistant_tokens"] = int(tok["loss_mask"].sum())
    info["phases"]["tokens_s"] = round(time.monotonic() - t0, 1)
    save_info()

    # 3. train: calibrate, then size the schedule to the time left ---------------------------
    base = [py, "-m", "eagle3_jax.train", "--config", args.config,
            f"target={args.target}", f"train_data={tokens}", f"out_dir={run_dir}",
            f"batch_size={args.batch_size}", f"max_len={args.max_len}",
            f"ttt_steps={args.ttt_steps}", f"optimizer.learning_rate={args.learning_rate}",
            "optimizer.warmup_steps=20", "progress=false", "eval_batches=8",
            "keep_checkpoints=2"]
    base += ([f"init_head={args.init_head}", "draft_vocab=null"] if args.init_head
             else [f"draft_vocab={vocab}", f"draft_vocab_size={args.draft_vocab_size}"])
    base += args.train
    t0 = time.monotonic()
    k = max(args.calibrate_steps, 6) // 2 * 2
    # Evaluate and save at k/2 and k: the step after k/2 then carries the cost of one eval with
    # its plot and one checkpoint, which the sized run pays at each of its EVALS points.
    ok = run(base + ["total_steps=100000", f"save_every={k // 2}", f"eval_every={k // 2}",
                     "log_every=1", "--max-steps", str(k)], env=env,
             seconds=max(deadline - time.monotonic() - args.export_s, 1))
    calibrate_s = time.monotonic() - t0
    recs = train_records(run_dir / "metrics.jsonl")
    if not ok or len(recs) < k:
        log("calibration run failed")
        return 1
    step_s, event_s = step_and_event_seconds(recs, k)
    overhead = calibrate_s - k * step_s - 2 * event_s    # start-up, loading, compilation, exit
    left = deadline - time.monotonic() - args.export_s - overhead - EVALS * event_s
    total = args.steps or k + max(int(left / (step_s * STEP_MARGIN)), 0)
    info["train"] = {"step_s": round(step_s, 4), "eval_save_s": round(event_s, 2),
                     "calibrate_s": round(calibrate_s, 1), "total_steps": total,
                     "tokens_per_s": round(recs[-1]["tokens_per_s"], 1)}
    log(f"step {step_s * 1e3:.0f} ms, eval + save {event_s:.1f} s, start-up {overhead:.0f} s: "
        f"training to step {total}")
    save_info()
    if total > k:
        run(base + [f"total_steps={total}", f"save_every={max(total // (EVALS // 2), 1)}",
                    "log_every=10", f"eval_every={max(total // EVALS, 1)}"], env=env,
            seconds=max(deadline - time.monotonic() - args.export_s + 20, 30))
    recs = train_records(run_dir / "metrics.jsonl")
    info["train"]["end_step"] = recs[-1]["step"] if recs else None
    info["phases"]["train_s"] = round(time.monotonic() - t0, 1)
    save_info()

    # 4. export ----------------------------------------------------------------------------
    run([py, "-m", "eagle3_jax.export", "--checkpoint", str(run_dir), "--out",
         str(out / "head"), "--dtype", "bfloat16"], env=env)
    for name in ("metrics.jsonl", "accuracy.png"):
        if (run_dir / name).is_file():
            shutil.copy(run_dir / name, out / name)
    info["phases"]["total_s"] = round(time.monotonic() - START, 1)
    save_info()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
