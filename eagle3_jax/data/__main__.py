"""``python -m eagle3_jax.data <command>``: build draft-head training data.

  prepare  --source sharegpt|PATH --out DIR [--limit N] [--exclude-bench DIR|none]
           [--strip-leading-assistant]
           read conversations, normalise them, write DIR/conversations.jsonl (+ prepare_stats.json)
  vocab    --data DIR|FILE --target PRESET_OR_PATH --draft-vocab-size N --out FILE.npz
           [--max-len 2048] [--vocab-size V] [--tokens-out FILE.npz]
           tokenise with the target's chat template, pick the draft vocabulary, save d2t/t2d
  regenerate --data DIR|FILE --out DIR --target T [--batch-size 8] [--max-new-tokens 512]
           [--max-turns N] [--limit N] [--temperature 0 --top-p 1 --top-k 0 --seed 0]
           replace assistant turns with the target's own answers (resumable)
  features --data TOKENS.npz --target T --out DIR --max-len L [--batch-size 8]
           [--dtype bfloat16|float16|float32]
           store the target's taps and final hidden states for offline training (resumable)

Errors in the input are reported in one line (``error: ...``), exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3_jax.data.sources import CONVERSATIONS_FILE
from eagle3_jax.compile_cache import enable_compile_cache
from eagle3_jax.errors import run_cli


# The evaluation prompts shipped with the benchmarks; `prepare` drops them by default.
BENCH_PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts"

def cmd_prepare(args: argparse.Namespace) -> None:
    from eagle3_jax.data.sources import (load_benchmark_prompts, prepare_conversations,
                                         write_jsonl)

    bench = args.exclude_bench if args.exclude_bench not in (None, "", "none") else None
    excluded = load_benchmark_prompts(bench) if bench else set()
    convs, stats = prepare_conversations(args.source, limit=args.limit, exclude_prompts=excluded,
                                         strip_leading_assistant=args.strip_leading_assistant,
                                         progress=True)
    out = Path(args.out)
    path = write_jsonl(convs, out / CONVERSATIONS_FILE)
    summary = {"source": args.source, "read": stats.read, "kept": stats.kept,
               "dropped": dict(stats.dropped), "truncated_tail": stats.truncated_tail,
               "excluded_prompts": len(excluded)}
    (out / "prepare_stats.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{stats.summary()}\nwrote {path}")


def cmd_vocab(args: argparse.Namespace) -> None:
    from eagle3_jax.data.sources import read_conversations
    from eagle3_jax.data.tokenize import TokenizedRecords, load_tokenizer, tokenize_conversations
    from eagle3_jax.data.vocab import build_draft_vocab, save_vocab

    tokenizer = load_tokenizer(args.target)
    vocab_size = args.vocab_size or len(tokenizer)
    if Path(args.data).suffix == ".npz":  # already tokenised
        records, skipped = TokenizedRecords.load(args.data), 0
    else:
        records, skipped = tokenize_conversations(tokenizer, read_conversations(args.data),
                                                  max_len=args.max_len, progress=True)
    if args.tokens_out:
        print(f"wrote {records.save(args.tokens_out)} ({len(records)} records)")
    used, counts = build_draft_vocab(records, vocab_size, args.draft_vocab_size)
    path = save_vocab(args.out, used, vocab_size, counts)
    covered = counts[used].sum() / max(counts.sum(), 1)
    print(f"{len(records)} conversations ({skipped} without assistant tokens skipped), "
          f"{int(counts.sum())} assistant tokens, {int((counts > 0).sum())} distinct; "
          f"draft vocab {len(used)} of {vocab_size} covers {covered:.2%}\nwrote {path}")


TARGET_HELP = "preset name, .gguf file, HF folder or Hugging Face hub id (org/name)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="read and normalise conversations")
    p.add_argument("--source", required=True, help="'sharegpt' or a .jsonl/.json/.parquet path")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--limit", type=int, default=None, help="read at most N raw records")
    p.add_argument("--exclude-bench", default=str(BENCH_PROMPTS), metavar="DIR",
                   help="drop conversations whose first user turn is a prompt of a "
                        "DIR/**/question.jsonl benchmark file (default: the five evaluation "
                        "sets shipped in eagle3_jax/bench/prompts: never train on them); "
                        "'none' keeps everything")
    p.add_argument("--strip-leading-assistant", action="store_true",
                   help="drop assistant messages before the first user message (as the EAGLE "
                        "reference does) instead of dropping the conversation")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("vocab", help="tokenise and build the draft vocabulary")
    p.add_argument("--data", required=True,
                   help="prepare output folder, a conversations .jsonl, or tokenised .npz")
    p.add_argument("--target", default=None, help=TARGET_HELP)
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, help="output .npz (d2t, t2d, used_ids, counts)")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="target vocabulary size (embedding rows); default: the tokenizer's")
    p.add_argument("--tokens-out", default=None, help="also save the tokenised records (.npz)")
    p.set_defaults(func=cmd_vocab)

    # Further commands register here, e.g. `regenerate` (responses re-generated by the target):
    # add a sub-parser with set_defaults(func=cmd_regenerate), raising DataError on bad input.
    p = sub.add_parser("regenerate", help="replace assistant turns with the target's answers")
    p.add_argument("--data", required=True, help="prepare output folder or conversations .jsonl")
    p.add_argument("--out", required=True, help="output folder (resumed if it exists)")
    p.add_argument("--target", default=None, help=TARGET_HELP)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-turns", type=int, default=None,
                   help="answer only the first N user turns")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="a longer prompt ends the conversation before that turn (default "
                        "min(2048, context - max-new-tokens))")
    p.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    p.add_argument("--shortest", type=int, default=None, metavar="N",
                   help="only the N conversations with the shortest openings (system + first "
                        "user turn; the order they are answered in), e.g. a budget that an "
                        "interrupted run resumes to exactly")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="target parameter dtype (default: its own)")
    p.set_defaults(func=cmd_regenerate)

    p = sub.add_parser("features", help="store the target's taps and hidden states (offline)")
    p.add_argument("--data", required=True, help="tokenised records .npz (vocab --tokens-out)")
    p.add_argument("--target", default=None, help=TARGET_HELP)
    p.add_argument("--out", required=True, help="output folder (resumed if it exists)")
    p.add_argument("--max-len", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="storage dtype of taps and hidden states")
    p.add_argument("--records-per-shard", type=int, default=256)
    p.add_argument("--target-dtype", default=None, help="target compute dtype (default: its own)")
    p.set_defaults(func=cmd_features)
    return parser


def cmd_regenerate(args: argparse.Namespace) -> None:
    from eagle3_jax.data.regenerate import (load_conversations, load_target_or_error,
                                            regenerate_conversations)
    from eagle3_jax.decoding.sampling import sampling_from_flags

    sampling = sampling_from_flags(args.temperature, args.top_p, args.top_k)
    conversations = load_conversations(args.data, args.limit)  # bad data fails before loading
    target = load_target_or_error(args.target, dtype=args.dtype)
    stats = regenerate_conversations(
        conversations, target, args.out, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
        max_prompt_len=args.max_prompt_len, sampling=sampling, seed=args.seed, progress=True,
        shortest=args.shortest)
    print(f"{stats.summary()}\nwrote {Path(args.out) / CONVERSATIONS_FILE}")


def cmd_features(args: argparse.Namespace) -> None:
    from eagle3_jax.data.features import extract_features
    from eagle3_jax.data.regenerate import load_target_or_error
    from eagle3_jax.data.tokenize import TokenizedRecords

    records = TokenizedRecords.load(args.data)  # bad data fails before loading the target
    target = load_target_or_error(args.target, dtype=args.target_dtype)
    stats = extract_features(records, target, args.out, max_len=args.max_len,
                             batch_size=args.batch_size, dtype=args.dtype,
                             records_per_shard=args.records_per_shard, progress=True)
    print(f"{stats.summary()}\nwrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    enable_compile_cache()
    return run_cli(lambda: args.func(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
