"""What the model families' own layers cost: ``bench forward --moe`` and ``--window W``.

* ``--moe``: one mixture-of-experts MLP (Qwen3-30B-A3B's shape scaled down: 64 experts of
  width 256 over hidden 512, 8 a token) over T tokens, the routed form the target runs
  (``eagle3_jax.model.moe.moe_mlp``: tokens sorted by expert, only the chosen experts' weights
  read) against the all-experts form (every expert on every token, weighted by the router:
  what ``jax.lax.ragged_dot`` lowers to on CPU, E/k = 8 times the FLOPs), interleaved, medians.
* ``--window W``: the loaded target with a sliding window of W on every layer, one forward of
  T = 1 and 16 tokens after ``--context`` cached tokens (the window is a mask over the whole
  cache, so every slot is still read) against the same forward after W cached tokens (what a
  ring buffer of W slots would read), and without a window at ``--context`` (the mask's own
  cost).
"""

from __future__ import annotations

import statistics
import sys

import jax

from eagle3_jax.bench.common import markdown_table
from eagle3_jax.decoding.costs import forward_curve, interleaved_medians

MOE_SHAPE = dict(hidden=512, width=256, experts=64, per_token=8)


def moe_times(tokens, repeats: int, seed: int = 0) -> dict[int, dict[str, float]]:
    """Median ms of the routed and the all-experts MoE MLP per token count, interleaved."""
    from eagle3_jax.model.moe import moe_mlp, moe_mlp_all_experts

    d, f, e, k = (MOE_SHAPE[n] for n in ("hidden", "width", "experts", "per_token"))
    keys = jax.random.split(jax.random.key(seed), 5)
    router = jax.random.normal(keys[0], (e, d)) / d ** 0.5
    gate, up = (jax.random.normal(kk, (e, d, f)) / d ** 0.5 for kk in keys[1:3])
    down = jax.random.normal(keys[3], (e, f, d)) / f ** 0.5
    forms = {"routed": moe_mlp, "all experts": moe_mlp_all_experts}
    out = {}
    for t in tokens:
        x = jax.random.normal(jax.random.fold_in(keys[4], t), (t, d))
        fns = {}
        for name, fn in forms.items():
            run = jax.jit(lambda x, fn=fn: fn(x, router, gate, up, down, top_k=k, normalize=True))
            fns[name] = lambda run=run, x=x: run(x)
        out[t] = {name: s * 1e3 for name, s in interleaved_medians(fns, repeats, 2).items()}
    return out


def window_times(params, cfg, window: int, context: int, sizes, repeats: int,
                 rounds: int) -> dict[str, dict[int, float]]:
    """Median ms of forwards over ``sizes`` new tokens: the window as a mask over ``context``
    cached tokens, over ``window`` cached ones (a ring buffer's reads) and no window at
    ``context``; alternating rounds, medians over them."""
    windowed = cfg.replace(sliding_window=window, layer_pattern="")
    runs = {"window mask, full cache": (windowed, context),
            "ring-buffer reads (W cached)": (windowed, window),
            "no window, full cache": (cfg, context)}
    samples: dict[str, dict[int, list[float]]] = {n: {t: [] for t in sizes} for n in runs}
    for _ in range(rounds):
        for name, (c, ctx) in runs.items():
            for t, s in forward_curve(params, c, ctx, sizes, repeats).items():
                samples[name][t].append(s * 1e3)
    return {n: {t: statistics.median(v) for t, v in by_t.items()} for n, by_t in samples.items()}


def main_moe(args) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    times = moe_times(sizes, args.repeats)
    print(f"MoE MLP {MOE_SHAPE}, float32, {jax.default_backend()}", file=sys.stderr)
    print(markdown_table(["T tokens", "routed ms", "all experts ms", "all / routed"],
                         [(t, v["routed"], v["all experts"], v["all experts"] / v["routed"])
                          for t, v in times.items()]))
    return {"shape": MOE_SHAPE, "ms": {str(t): v for t, v in times.items()}}


def main_window(args, loaded) -> dict:
    sizes = (1, 16)
    times = window_times(loaded.params, loaded.cfg, args.window, args.context, sizes,
                         args.repeats, args.rounds)
    print(f"{loaded.source}: window {args.window}, context {args.context}", file=sys.stderr)
    print(markdown_table(["form"] + [f"T={t} ms" for t in sizes],
                         [(name, *(v[t] for t in sizes)) for name, v in times.items()]))
    return {"window": args.window, "context": args.context,
            "ms": {n: {str(t): v for t, v in by_t.items()} for n, by_t in times.items()}}

