"""``python -m eagle3_jax.bench prefill``: what a prompt's prefill costs.

A decoder pads a prompt to its bucket (``eagle3_jax.decoding.bucket``: 16 x 2^i slots, so one
compilation serves many lengths) and runs it into a fresh KV cache before the first token.
Timed here, per prompt length, interleaved, medians:

  * **one forward** over the whole bucket (``prefill(..., chunk=None)``): the padding costs as
    much as the prompt;
  * **as the decoders run it** (``chunk="auto"``, ``eagle3_jax.model.target.prefill_chunk``): on
    CPU with the kernels, forwards of ``PREFILL_CHUNK`` tokens in a ``while_loop`` that stops
    after the chunk holding the prompt's last token;

each also in decode steps (one decode step over the same cache, timed in the same run), the
unit in which the prefill dilutes a speed-up measured per request. A table, JSON and a plot.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.bench.common import machine_description, markdown_table, write_json


def prefill_times(params, cfg, length: int, max_new_tokens: int, repeats: int,
                  seed: int = 0) -> dict[str, float]:
    """Median seconds of the prefill of one ``length``-token prompt (random ids) padded to its
    bucket, as one forward ("one forward") and as the decoders run it ("decoders"), and of one
    decode step after it ("decode step"), interleaved."""
    from eagle3_jax.decoding import bucket
    from eagle3_jax.decoding.costs import forward_step, interleaved_medians
    from eagle3_jax.decoding.generate import cache_size
    from eagle3_jax.model.target import prefill
    from eagle3_jax.sharding import replicated_like

    width = bucket(length)
    max_len = cache_size(cfg, width, max_new_tokens)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, width))
    ids[:, length:] = 0
    tokens, lengths = jnp.asarray(ids, jnp.int32), jnp.array([length], jnp.int32)
    # The weights are an argument, as in the decoders: closed over, XLA would compile them into
    # the program as constants (slow to compile, and not the program that decodes).
    runs = {name: jax.jit(lambda p, t, n, chunk=chunk: prefill(p, cfg, t, n, max_len,
                                                               chunk=chunk))
            for name, chunk in (("one forward", None), ("decoders", "auto"))}
    state = {"cache": runs["one forward"](params, tokens, lengths).cache}

    # The step's token, and the cache's end moved back to the prompt's end, on the mesh where the
    # cache lies: one program. (A new end each time: forward_step donates the whole cache.)
    token = replicated_like(jnp.ones((1, 1), jnp.int32), params)

    def decode_step():  # forward_step donates the cache: keep the one it returns
        logits, new = forward_step(params, state["cache"], token, cfg)
        state["cache"] = new.replace(end=jax.device_put(np.array([length], np.int32),
                                                        new.end.sharding))
        return logits

    fns = {name: (lambda run=run: run(params, tokens, lengths).logits)
           for name, run in runs.items()}
    fns["decode step"] = decode_step
    return interleaved_medians(fns, repeats, warmup=1)


def plot(path: str, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = [r["length"] for r in rows]
    ax.plot(lengths, [r["one_forward_ms"] for r in rows], "s--", label="one forward over the bucket")
    ax.plot(lengths, [r["decoders_ms"] for r in rows], "o-", label="as the decoders run it")
    for r in rows:
        ax.axvline(r["bucket"], color="gray", lw=0.5, ls=":")
    ax.set_xlabel("prompt tokens (dotted: bucket edges)")
    ax.set_ylabel("prefill ms")
    ax.set_title("Prefill of one prompt into a fresh cache")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.bench prefill",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="preset, HF folder or .gguf (default model)")
    parser.add_argument("--lengths", default="50,70,100,130,200,260,300,400,500,700,1000",
                        help="prompt lengths in tokens")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="sizes the cache as the decoders do (bucket(prompt + this))")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/bench_prefill.json")
    parser.add_argument("--plot", default="docs/bench_prefill.png")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.decoding import bucket
    from eagle3_jax.kernels import kernel_status
    from eagle3_jax.model.target import prefill_chunk

    loaded = load_target(args.target)
    cfg, params = loaded.cfg, loaded.params
    print(f"target {loaded.source}; {kernel_status()}", file=sys.stderr)
    rows = []
    for length in (int(n) for n in args.lengths.split(",") if n):
        t = prefill_times(params, cfg, length, args.max_new_tokens, args.repeats)
        step = t["decode step"]
        rows.append({"length": length, "bucket": bucket(length),
                     "chunk": prefill_chunk(cfg, bucket(length)),
                     "one_forward_ms": t["one forward"] * 1e3, "decoders_ms": t["decoders"] * 1e3,
                     "decode_step_ms": step * 1e3,
                     "one_forward_steps": t["one forward"] / step,
                     "decoders_steps": t["decoders"] / step})
        print(f"  {length} tokens: {rows[-1]['one_forward_ms']:.0f} -> "
              f"{rows[-1]['decoders_ms']:.0f} ms", file=sys.stderr)
    print(markdown_table(
        ["prompt tokens", "bucket", "chunk", "one forward ms", "decoders ms", "ratio",
         "one forward (decode steps)", "decoders (decode steps)"],
        [(r["length"], r["bucket"], r["chunk"] or "-", r["one_forward_ms"], r["decoders_ms"],
          r["one_forward_ms"] / r["decoders_ms"], r["one_forward_steps"], r["decoders_steps"])
         for r in rows]))
    write_json(args.out, {"machine": machine_description(), "target": loaded.source,
                          "kernel": kernel_status(), "max_new_tokens": args.max_new_tokens,
                          "repeats": args.repeats, "rows": rows})
    plot(args.plot, rows)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
