"""``python -m eagle3_jax.bench forward``: the target's forward cost curve and plain-decoding speed.

Measures, on the running machine:
  * one decode step (T = 1) and a forward of T = 2, 4, ..., 64 new tokens over a 256-token cache:
    the cost curve that sizes draft trees (a tree of T tokens costs about forward(T));
  * the per-token time of plain decoding's inner loop: ``LOOP_STEPS`` greedy decode steps in one
    jitted ``lax.fori_loop`` from the same cache (no per-call dispatch, no prefill), interleaved
    with the forwards;
  * the memory-bandwidth floor of a decode step: parameter bytes / bandwidth measured in the same
    run (a jitted full read of an array as large as the parameters);
  * greedy tokens/s of ``eagle3_jax.decoding.generate`` against HF transformers float32 greedy
    ``generate`` on the same chat prompts, batch 1, interleaved, medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.bench.common import machine_description, markdown_table, write_json
from eagle3_jax.decoding.costs import LOOP_STEPS, forward_curve, interleaved_medians
from eagle3_jax.model.params import param_bytes

PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime.",
    "Give me three tips for learning a new language.",
)


def measure_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of a jitted reduction that reads an array of ``num_bytes`` once."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    read = jax.jit(lambda a: jnp.sum(a))
    seconds = interleaved_medians({"read": lambda: read(x)}, repeats, warmup=2)["read"]
    return num_bytes / seconds


def greedy_speed(loaded, hf_model, max_new_tokens: int, repeats: int):
    """Interleaved greedy tokens/s: ours (one jitted while_loop) vs HF transformers float32."""
    import torch

    from eagle3_jax.decoding import generate, pad_prompts

    tok = loaded.tokenizer
    eos = tok.eos_token_ids
    ours_tps, hf_tps, same = [], [], []
    for _ in range(repeats + 1):  # the first round compiles / warms up and is not counted
        for text in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": text}])
            padded = pad_prompts([ids])
            start = time.perf_counter()
            out = generate(loaded.params, loaded.cfg, padded.tokens, padded.lengths,
                           max_new_tokens=max_new_tokens, eos_token_ids=eos)
            ours = np.asarray(out.tokens[0, : int(out.num_generated[0])])
            t_ours = time.perf_counter() - start
            start = time.perf_counter()
            with torch.no_grad():
                hf_out = hf_model.generate(torch.tensor([ids]), do_sample=False,
                                           max_new_tokens=max_new_tokens, eos_token_id=list(eos),
                                           pad_token_id=tok.pad_token_id)
            t_hf = time.perf_counter() - start
            theirs = hf_out[0, len(ids):].numpy()
            theirs = theirs[~np.isin(theirs, eos)]
            if _ > 0:
                ours_tps.append(len(ours) / t_ours)
                hf_tps.append(len(theirs) / t_hf)
                same.append(bool(np.array_equal(ours, theirs)))
    return statistics.median(ours_tps), statistics.median(hf_tps), all(same)


def load_hf_reference(path):
    """The same checkpoint in HF transformers (torch, float32): a GGUF file or an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                     local_files_only=True)
    return model.eval()


def plot_curve(path: str, curve_ms: dict[int, float], floor_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = sorted(curve_ms)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [curve_ms[t] for t in sizes], "o-", label="forward over 256-token cache")
    ax.axhline(floor_ms, color="gray", ls="--", label="bandwidth floor (params / BW)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens T (tree size)")
    ax.set_ylabel("ms per forward")
    ax.set_title("Target forward cost (SmolLM2-135M, this machine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.bench forward",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="preset, HF folder or .gguf (default model)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--speed-repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="skip the HF transformers run")
    parser.add_argument("--out", default="docs/bench_forward.json")
    parser.add_argument("--plot", default="docs/bench_forward.png")
    args = parser.parse_args(argv)

    from eagle3_jax.checkpoints import load_target

    loaded = load_target(args.target)
    cfg, params = loaded.cfg, loaded.params
    sizes = [int(s) for s in args.sizes.split(",")]
    nbytes = param_bytes(params)
    print(f"target {loaded.source}: {cfg.num_params / 1e6:.1f}M params, {nbytes / 2**20:.0f} MiB",
          file=sys.stderr)
    bandwidth = measure_bandwidth(nbytes, args.repeats)
    curve = forward_curve(params, cfg, args.context, sizes, args.repeats, loop_steps=LOOP_STEPS)
    floor = nbytes / bandwidth
    rows = [(t, curve[t] * 1e3, curve[t] / curve[1]) for t in sizes]
    print(markdown_table(["T new tokens", "ms / forward", "x decode step"], rows))
    print(f"\nbandwidth {bandwidth / 1e9:.2f} GB/s -> decode floor {floor * 1e3:.2f} ms; "
          f"decode step {curve[1] * 1e3:.2f} ms = {curve[1] / floor:.2f}x floor; "
          f"in the jitted decode loop {curve['loop'] * 1e3:.2f} ms/token = "
          f"{curve['loop'] / floor:.2f}x floor")
    result = {
        "machine": machine_description(), "target": loaded.source, "param_bytes": nbytes,
        "context": args.context, "forward_ms": {str(t): curve[t] * 1e3 for t in sizes},
        "bandwidth_gb_s": bandwidth / 1e9, "decode_floor_ms": floor * 1e3,
        "decode_step_over_floor": curve[1] / floor,
        "decode_loop_ms_per_token": curve["loop"] * 1e3,
        "decode_loop_over_floor": curve["loop"] / floor,
    }
    if not args.skip_hf:
        hf = load_hf_reference(loaded.weights)
        ours, theirs, same = greedy_speed(loaded, hf, args.max_new_tokens, args.speed_repeats)
        print(f"\ngreedy batch 1, {args.max_new_tokens} new tokens, median of "
              f"{args.speed_repeats}x{len(PROMPTS)}: eagle3_jax {ours:.1f} tok/s, HF transformers "
              f"float32 {theirs:.1f} tok/s -> {ours / theirs:.2f}x; identical tokens: {same}")
        result.update(tokens_per_s_ours=ours, tokens_per_s_hf=theirs, speedup_vs_hf=ours / theirs,
                      identical_tokens=same, max_new_tokens=args.max_new_tokens)
    write_json(args.out, result)
    plot_curve(args.plot, {t: curve[t] * 1e3 for t in sizes}, floor * 1e3)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)
    return 0
