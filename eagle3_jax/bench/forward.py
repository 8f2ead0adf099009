"""``python -m eagle3_jax.bench forward``: the target's forward cost curve and plain-decoding speed.

Measures, on the running machine:
  * one decode step (T = 1) and a forward of T = 2, 4, ..., 64 new tokens over a 256-token cache:
    the cost curve that sizes draft trees (a tree of T tokens costs about forward(T));
  * the per-token time of plain decoding's inner loop: ``LOOP_STEPS`` greedy decode steps in one
    jitted ``lax.fori_loop`` from the same cache (no per-call dispatch, no prefill), interleaved
    with the forwards;
  * the floors: bandwidth (parameter bytes / bandwidth measured in the same run by a jitted full
    read of an array as large as the parameters) and compute (the forward's FLOPs / the float32
    matmul peak measured in the same run), per T, and the ratios of each forward to the decode
    step and to max(floors);
  * every forward four times: XLA ops only; both CPU kernels on the [out, in] serving matrices
    (the few-row matmul kernel, ``eagle3_jax.kernels.matmul``, and the cached-attention kernel,
    ``eagle3_jax.kernels.attention``); the panel matmul kernel on the matrices as panels
    (``eagle3_jax.model.params.to_panels``); and both kernels on panels, what decoding runs
    (alternating rounds, medians), so the table shows what each form buys;
  * one draft step of the target's shipped head over w = 1, 4, 10 tokens (a tree level), as
    decoding holds it (bfloat16 matrices on CPU for a head of bfloat16 values) and, then, with
    the same values held in float32 (alternating rounds);
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
from eagle3_jax.compile_cache import drop_compiled_programs
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


def compute_floor_seconds(cfg, context: int, t: int, peak_flops: float) -> float:
    """FLOPs of a forward of ``t`` new tokens over ``context`` cached ones (2 per weight per
    token in the layers and the output head, plus attention's scores and sums) / the peak."""
    hd, layers = cfg.head_dim, cfg.num_layers
    # Every weight is a matmul but an untied input embedding (a lookup); tied, it is the head.
    lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    matmul_params = cfg.num_params - lookup
    attention = 4 * layers * cfg.num_heads * hd * (context + t) * t
    return (2 * matmul_params * t + attention) / peak_flops


def curves_by_kernel(params, cfg, context: int, sizes, repeats: int, rounds: int):
    """{"xla": curve, "rows kernel": curve, "matmul kernel": curve, "kernel": curve} (seconds
    per T, and "loop"): the same forwards with XLA ops only; with both CPU kernels on the
    [out, in] serving matrices (the form before panels); with the panel matmul kernel alone
    (XLA's attention); and with both kernels on panels, what decoding runs here. ``rounds``
    alternating rounds (recompiled each), per-T median of rounds. Only {"xla": ...} where the
    kernels are unavailable."""
    from eagle3_jax.kernels import library as rm
    from eagle3_jax.model.params import from_panels, to_panels

    previous = rm.set_kernel_enabled(None)
    # "kernel": what decoding runs here (the families this CPU prefers).
    defaults = tuple(f for f in rm.FAMILIES if rm.kernels_enabled(f))
    rows = from_panels(params, cfg)
    panels = to_panels(params, cfg) if rm.kernel_available() else rows
    settings = {"xla": (False, rows), "rows kernel": (None, rows),
                "matmul kernel": (tuple(f for f in defaults if f != "attention"), panels),
                "kernel": (None, panels)}
    modes = tuple(settings) if rm.kernel_available() else ("xla",)
    samples: dict[str, list[dict]] = {mode: [] for mode in modes}
    try:
        for _ in range(rounds):
            for mode in modes:
                switch, mode_params = settings[mode]
                rm.set_kernel_enabled(switch)
                drop_compiled_programs()  # re-trace under the switch; free the last mode's code
                samples[mode].append(forward_curve(mode_params, cfg, context, sizes, repeats,
                                                   loop_steps=LOOP_STEPS))
    finally:
        rm.set_kernel_enabled(previous)
        drop_compiled_programs()
    return {mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            for mode, runs in samples.items()}


def draft_step_ms(target: str | None, loaded, context: int, widths, repeats: int,
                  rounds: int = 2) -> dict[str, dict[int, float]] | None:
    """Milliseconds of one step of the shipped head of ``target`` over w tokens, or None:
    ``{"decoding": ...}`` as decoding holds it (``DraftHead.serving``) and, where that holds
    its matrices as bfloat16, ``"float32-held"`` for the same values in float32; alternating
    rounds, medians."""
    from eagle3_jax.decoding.costs import measure_draft_steps
    from eagle3_jax.draft.load import load_head
    from eagle3_jax.draft.params import to_serving
    from eagle3_jax.draft.shipped import shipped_head_for

    path = shipped_head_for(target)
    if path is None:
        return None
    head = load_head(path, loaded.cfg).head
    forms = {"decoding": head.serving()}
    if any(v.dtype == jnp.bfloat16 for v in forms["decoding"].params.values()):
        forms["float32-held"] = head.replace(params=to_serving(head.params))
    samples = {name: [] for name in forms}
    for _ in range(rounds if len(forms) > 1 else 1):
        for name, form in forms.items():
            samples[name].append(measure_draft_steps(form, loaded.params["embed"], context,
                                                     widths, repeats))
    return {name: {w: statistics.median(r[w] for r in runs) * 1e3 for w in widths}
            for name, runs in samples.items()}


def plot_curve(path: str, curves_ms: dict[str, dict[int, float]], bandwidth_ms: float,
               compute_ms: dict[int, float], draft_ms: dict[int, float] | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = sorted(compute_ms)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"kernel": ("o-", "forward, CPU kernels on panels (matmul + attention)"),
              "matmul kernel": ("^:", "forward, panel matmul kernel, XLA attention"),
              "rows kernel": ("d-.", "forward, CPU kernels on [out, in] matrices"),
              "xla": ("s--", "forward, XLA ops only")}
    for mode, curve in curves_ms.items():
        style, label = styles[mode]
        ax.plot(sizes, [curve[t] for t in sizes], style, label=label)
    ax.axhline(bandwidth_ms, color="gray", ls=":", label="bandwidth floor (params / BW)")
    ax.plot(sizes, [compute_ms[t] for t in sizes], color="gray", ls="-.",
            label="compute floor (FLOPs / matmul peak)")
    ax.plot(sizes, [max(bandwidth_ms, compute_ms[t]) for t in sizes], color="black", lw=0.8,
            label="floor: max of the two")
    if draft_ms:
        ax.plot(sorted(draft_ms), [draft_ms[w] for w in sorted(draft_ms)], "^-", color="tab:green",
                label="draft step over w tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("new tokens T (tree size) / draft width w")
    ax.set_ylabel("ms")
    ax.set_title("Target forward over a 256-token cache: measured and floors")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.bench forward",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="preset, HF folder or .gguf (default model)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating rounds of the curve with XLA ops, both kernels on the "
                             "[out, in] matrices, the panel matmul kernel, both kernels on panels")
    parser.add_argument("--draft-widths", default="1,4,10",
                        help="draft step widths to time with the target's shipped head")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--speed-repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="skip the HF transformers run")
    parser.add_argument("--out", default="docs/bench_forward.json")
    parser.add_argument("--plot", default="docs/bench_forward.png")
    parser.add_argument("--moe", action="store_true",
                        help="instead: a mixture-of-experts MLP, routed against all experts, over "
                             "--sizes tokens (eagle3_jax.bench.families)")
    parser.add_argument("--window", type=int, default=None, metavar="W",
                        help="instead: the target with a sliding window of W, as a mask over "
                             "--context cached tokens against W cached (a ring buffer's reads)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from eagle3_jax.bench import families
    from eagle3_jax.bench.common import measure_matmul_peak
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.kernels import kernel_status

    if args.moe:
        write_json(args.out, {"machine": machine_description(), **families.main_moe(args)})
        return 0
    loaded = load_target(args.target)
    if args.window:
        write_json(args.out, {"machine": machine_description(), "target": loaded.source,
                              **families.main_window(args, loaded)})
        return 0
    cfg, params = loaded.cfg, loaded.params
    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    nbytes = param_bytes(params)
    print(f"target {loaded.source}: {cfg.num_params / 1e6:.1f}M params, {nbytes / 2**20:.0f} MiB; "
          f"{kernel_status()}", file=sys.stderr)
    bandwidth = measure_bandwidth(nbytes, args.repeats)
    peak, peak_shape = measure_matmul_peak()
    curves = curves_by_kernel(params, cfg, args.context, sizes, args.repeats, args.rounds)
    best = curves.get("kernel", curves["xla"])
    decode = min(c[1] for c in curves.values())  # the decode step as decoding runs it
    floor_bw = nbytes / bandwidth
    floor_compute = {t: compute_floor_seconds(cfg, args.context, t, peak) for t in sizes}
    headers = ["T new tokens"] + [f"ms ({m})" for m in curves] + [
        "bandwidth floor ms", "compute floor ms", "x decode step", "x floor"]
    rows = []
    for t in sizes:
        floor = max(floor_bw, floor_compute[t])
        rows.append((t, *(c[t] * 1e3 for c in curves.values()), floor_bw * 1e3,
                     floor_compute[t] * 1e3, best[t] / decode, best[t] / floor))
    print(markdown_table(headers, rows))
    widths = [int(w) for w in args.draft_widths.split(",") if w]
    forms = draft_step_ms(args.target, loaded, args.context, widths, args.repeats,
                          args.rounds) if widths else None
    draft = forms and forms["decoding"]
    if draft:
        held = forms.get("float32-held")
        print("\n" + markdown_table(
            ["draft width w", "ms / draft step", "x decode step"]
            + (["ms, float32-held matrices"] if held else []),
            [(w, ms, ms / (decode * 1e3), *([held[w]] if held else [])) for w, ms in draft.items()]))
    print(f"\nbandwidth {bandwidth / 1e9:.2f} GB/s -> decode floor {floor_bw * 1e3:.2f} ms; "
          f"matmul peak {peak / 1e9:.0f} GFLOP/s ({peak_shape}); decode step {decode * 1e3:.2f} "
          f"ms = {decode / floor_bw:.2f}x floor; in the jitted decode loop "
          f"{best['loop'] * 1e3:.2f} ms/token = {best['loop'] / floor_bw:.2f}x floor")
    result = {
        "machine": machine_description(), "target": loaded.source, "param_bytes": nbytes,
        "context": args.context, "kernel": kernel_status(),
        "forward_ms": {str(t): best[t] * 1e3 for t in sizes},
        "forward_ms_by_mode": {m: {str(t): c[t] * 1e3 for t in sizes} for m, c in curves.items()},
        "forward_over_decode_step": {str(t): best[t] / decode for t in sizes},
        "bandwidth_gb_s": bandwidth / 1e9, "decode_floor_ms": floor_bw * 1e3,
        "matmul_peak_gflop_s": peak / 1e9, "matmul_peak_shape": peak_shape,
        "compute_floor_ms": {str(t): v * 1e3 for t, v in floor_compute.items()},
        "forward_over_floor": {str(t): best[t] / max(floor_bw, floor_compute[t]) for t in sizes},
        "decode_step_ms": decode * 1e3, "decode_step_over_floor": decode / floor_bw,
        "decode_loop_ms_per_token": best["loop"] * 1e3,
        "decode_loop_over_floor": best["loop"] / floor_bw,
        "draft_step_ms": None if not draft else {str(w): v for w, v in draft.items()},
        "draft_step_ms_float32_held": None if not forms or "float32-held" not in forms else
        {str(w): v for w, v in forms["float32-held"].items()},
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
    plot_curve(args.plot, {m: {t: c[t] * 1e3 for t in sizes} for m, c in curves.items()},
               floor_bw * 1e3, {t: v * 1e3 for t, v in floor_compute.items()}, draft)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)
    return 0
