"""``python -m eagle3_jax.bench calibrate``: a head's live acceptance against its modelled one.

Decodes held-out chat prompts (ShareGPT first user turns of 500-2000 characters, none of the
evaluation sets; :func:`eagle3_jax.data.sources.held_out_prompts`) greedily with a few tree
shapes, all prompts in one batch per tree, and compares each tree's measured tau with the one
the tree chooser models from the head's rates (:mod:`eagle3_jax.decoding.calibration`).
``--write`` stores the result as ``"live"`` in a released head's ``acceptance.json``, where the
chooser (``--total-tokens auto``) reads its scale; ``python -m eagle3_jax.export`` keeps it when
it rewrites the file for the same weights (``weights_sha256``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Sequence

from eagle3_jax.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle3_jax.bench calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", metavar="PATH", default=None,
                   help="EAGLE-3 head (default: the target's shipped head)")
    p.add_argument("--target", default=None, help="preset, HF folder or .gguf (default SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="as the answers the scale will serve (bench speed's default: 128)")
    p.add_argument("--write", action="store_true",
                   help="store the result in the released head's acceptance.json")
    p.add_argument("--out", default="bench_calibrate.json")
    return p


def main(argv: Sequence[str] | None = None, *, load_fn: Callable | None = None) -> int:
    from eagle3_jax.bench.common import run_bench_cli

    return run_bench_cli(build_parser(), run, argv, load_fn)


def run(args: argparse.Namespace, load_fn: Callable | None = None) -> dict:
    import numpy as np

    from eagle3_jax.bench.common import draft_or_shipped, write_json
    from eagle3_jax.bench.speed import PROMPTS_DIR
    from eagle3_jax.cli.output import log
    from eagle3_jax.data.sources import (HELD_OUT_CHARS, held_out_prompts,
                                         load_benchmark_prompts)
    from eagle3_jax.decoding.calibration import live_level_scale, measure_accept_scale
    from eagle3_jax.decoding.decoders import EagleDecoder
    from eagle3_jax.decoding.sampling import sampling_from_flags
    from eagle3_jax.draft.load import ACCEPTANCE_FILE, check_head_path, load_head
    from eagle3_jax.draft.export import weights_digest

    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise UsageError("--num-prompts and --max-new-tokens must be >= 1")
    folder = check_head_path(draft_or_shipped(args.draft, args.target))
    acceptance = folder / ACCEPTANCE_FILE
    if args.write and not acceptance.is_file():
        raise UsageError(f"--write needs a released head with an {ACCEPTANCE_FILE}; {folder} has "
                         "none (export the run first: python -m eagle3_jax.export)")
    if load_fn is None:
        from eagle3_jax.checkpoints import load_target as load_fn
    target = load_fn(args.target)
    loaded = load_head(folder, target.cfg).serving()
    if loaded.accept_rates is None:
        raise UsageError(f"{folder} has no measured acceptance rates to calibrate")
    texts = held_out_prompts(args.num_prompts, exclude=load_benchmark_prompts(PROMPTS_DIR))
    prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                    add_generation_prompt=True) for t in texts]
    log(f"[calibrate: {loaded.description} on {len(prompts)} held-out ShareGPT prompts "
        f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {args.max_new_tokens} new "
        f"tokens each]")
    sampling = sampling_from_flags(0.0, 1.0, 0)

    def decode(tree):
        decoder = EagleDecoder(target, sampling, args.max_new_tokens, 0, head=loaded.head,
                               tree=tree)
        return np.sum([g.accept_hist for g in decoder.generate_batch(prompts)], axis=0)

    result = measure_accept_scale(decode, loaded.accept_rates, log=log)
    result.update(prompts={"source": "sharegpt first user turns", "min_chars": HELD_OUT_CHARS[0],
                           "max_chars": HELD_OUT_CHARS[1], "count": len(prompts)},
                  max_new_tokens=args.max_new_tokens, head=loaded.description,
                  weights_sha256=(weights_digest(folder)
                                  if (folder / "model.safetensors").is_file() else None))
    scale, decay = live_level_scale(result, loaded.accept_rates)
    log(f"[calibrate: scale {result['scale']:.3f} (live tau - 1 over modelled tau - 1); the "
        f"chooser's per-level fit {scale:.3f} x {decay:.2f}^level]")
    write_json(Path(args.out), result)
    if args.write:
        record = json.loads(acceptance.read_text())
        record["live"] = result
        tmp = acceptance.with_name(f"{acceptance.name}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(acceptance)  # atomic: the head keeps a whole file
        log(f"[calibrate: wrote the scale to {acceptance}]")
    return result


if __name__ == "__main__":
    raise SystemExit(main())
