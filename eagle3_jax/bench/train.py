"""``python -m eagle3_jax.bench train``: tokens/s and memory of one draft-head training step.

The step is the real one (``eagle3_jax.train.step.train_step``, online: the frozen target runs
inside it), on random tokens of the preset's shapes. Reported: median seconds per optimiser step
and tokens/s (interleaved with the target-only forward that online training pays for, so the
head's own share is visible), XLA's compiled memory estimate for the step (arguments, outputs,
temporaries) and the process's peak resident memory. Achieved FLOP/s of the whole step and of
the head's part (step minus target forward) are quoted against this machine's float32 matmul
peak measured in the same run (``bench.common.measure_matmul_peak``).

FLOPs counted (multiply-add = 2): the target forward, 2 * params per token; the head, per token
and TTT step, its projections (q/k/v from 2D, o, the SwiGLU, the draft-vocabulary head) plus
attention over all T keys of the row as computed (the causal half is masked, not skipped),
``fc`` once, and the backward pass at twice the forward.
"""

from __future__ import annotations

import argparse
import functools
import resource
import sys

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.bench.common import machine_description, markdown_table, write_json
from eagle3_jax.decoding.costs import interleaved_medians


def head_flops_per_token(dcfg, max_len: int) -> float:
    """Forward + backward FLOPs of the TTT head per token (module docstring)."""
    d, f, h = dcfg.hidden_size, dcfg.intermediate_size, dcfg.head_dim
    n, k = dcfg.num_heads, dcfg.num_kv_heads
    per_step = 2 * (2 * d * (n + 2 * k) * h + n * h * d + 3 * d * f + d * dcfg.draft_vocab_size)
    per_step += 2 * 2 * n * h * max_len  # scores and values over the row's keys
    return 3 * (dcfg.ttt_steps * per_step + 2 * 3 * d * d)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.bench train",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="preset, HF folder or .gguf (default model)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/bench_train.json")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.draft import DraftConfig, VocabMap, init_draft_params
    from eagle3_jax.train.inputs import TargetInputs, target_ttt_batch
    from eagle3_jax.train.config import OptimizerConfig
    from eagle3_jax.train.step import TrainState, train_step

    loaded = load_target(args.target, layout="stacked")  # training runs the target stacked
    tcfg, params = loaded.cfg, loaded.params
    dcfg = DraftConfig.for_target(tcfg, draft_vocab_size=args.draft_vocab_size,
                                  ttt_steps=args.ttt_steps)
    # Which ids form the draft vocabulary does not change the cost.
    vocab = VocabMap.from_used_ids(np.arange(dcfg.draft_vocab_size), tcfg.vocab_size)
    optimizer = OptimizerConfig().build()
    state = TrainState.create(init_draft_params(dcfg, jax.random.key(0)), optimizer,
                              jax.random.key(1))
    a, b, t = args.grad_accum, args.batch_size, args.max_len
    tokens = jax.random.randint(jax.random.key(2), (a, b, t), 0, tcfg.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((a, b, t), bool),
             "segment_ids": jnp.ones((a, b, t), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (a, b, t))}

    step = jax.jit(functools.partial(train_step, make_inputs=TargetInputs(tcfg, dcfg),
                                     draft_cfg=dcfg, optimizer=optimizer), donate_argnums=(0,))
    compiled = step.lower(state, params, vocab, batch).compile()
    memory = compiled.memory_analysis()
    target_only = jax.jit(lambda p, v, x: target_ttt_batch(p, tcfg, dcfg, v, x))
    micro = jax.tree.map(lambda x: x[0], batch)

    holder = {"state": state}

    def run_step():
        holder["state"], metrics = compiled(holder["state"], params, vocab, batch)
        return metrics

    seconds = interleaved_medians({"step": run_step,
                                   "target": lambda: target_only(params, vocab, micro)},
                                  args.repeats, warmup=1)
    tokens_per_step = a * b * t
    from eagle3_jax.bench.common import measure_matmul_peak

    peak, peak_shape = measure_matmul_peak()
    head_seconds = seconds["step"] - seconds["target"] * a
    head_flops = head_flops_per_token(dcfg, t) * tokens_per_step
    target_flops = 2 * tcfg.num_params * tokens_per_step
    flops = {"matmul_peak_gflops": peak / 1e9, "matmul_peak_shape": peak_shape,
             "step_gflops": (head_flops + target_flops) / seconds["step"] / 1e9,
             "head_gflops": head_flops / max(head_seconds, 1e-9) / 1e9,
             "target_gflops": target_flops / (seconds["target"] * a) / 1e9}
    flops["head_share_of_peak"] = flops["head_gflops"] * 1e9 / peak
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    mib = lambda n: n / 2**20  # noqa: E731
    xla = {"argument_mib": mib(memory.argument_size_in_bytes),
           "output_mib": mib(memory.output_size_in_bytes),
           "temp_mib": mib(memory.temp_size_in_bytes)} if memory is not None else {}
    rows = [("optimiser step (target inside)", seconds["step"], tokens_per_step / seconds["step"]),
            ("target forward + labels only", seconds["target"] * a,
             tokens_per_step / (seconds["target"] * a))]
    rows.append(("head's part (difference)", head_seconds, tokens_per_step / head_seconds))
    print(markdown_table(["", "s / step", "tokens/s"], rows))
    print(f"\nfloat32 matmul peak here {flops['matmul_peak_gflops']:.0f} GFLOP/s ({peak_shape}); "
          f"achieved: step {flops['step_gflops']:.0f}, target forward "
          f"{flops['target_gflops']:.0f}, head {flops['head_gflops']:.0f} GFLOP/s "
          f"({flops['head_share_of_peak']:.0%} of peak)")
    print(f"\n{a}x{b}x{t} tokens per step, {args.ttt_steps} TTT steps, draft vocab "
          f"{args.draft_vocab_size}; XLA memory estimate "
          + ", ".join(f"{k} {v:.0f} MiB" for k, v in xla.items())
          + f"; peak RSS {mib(peak_rss):.0f} MiB")
    write_json(args.out, {
        "machine": machine_description(), "target": loaded.source,
        "shape": {"grad_accum": a, "batch_size": b, "max_len": t, "ttt_steps": args.ttt_steps,
                  "draft_vocab_size": args.draft_vocab_size},
        "seconds_per_step": seconds["step"], "tokens_per_s": tokens_per_step / seconds["step"],
        "target_seconds_per_step": seconds["target"] * a,
        "head_seconds_per_step": head_seconds, "flops": flops,
        "xla_memory": xla, "peak_rss_mib": mib(peak_rss),
    })
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
