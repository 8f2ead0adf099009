"""The benchmark commands run end to end on the default model and write what they promise
(short settings: these check the plumbing, the numbers live in docs/BENCHMARKS.md)."""

import json

import pytest

from eagle3_jax.bench.__main__ import main
from test_eagle_cli import steady_costs  # noqa: F401 (the tree chooser's timings, fixed)


@pytest.fixture
def default_target(smollm2_target, monkeypatch):
    """The commands' ``load_target`` hands them the session's default target (what it reads
    for no ``--target``; tests/test_decode_cli.py runs that read itself) instead of reading the
    GGUF again; returns the targets asked for."""
    asked = []

    def load_target(target=None, **kwargs):
        asked.append((target, kwargs))
        assert target is None and not kwargs, (target, kwargs)
        return smollm2_target

    monkeypatch.setattr("eagle3_jax.checkpoints.load_target", load_target)
    return asked


def test_bench_forward_writes_curve_and_floor(default_target, tmp_path):
    """The sizes, context and draft widths are the tree chooser's (its forwards of 1 and 64
    tokens after 128 cached, its draft steps over 1 and 16): within one run of the suite the
    decoder's chooser (tests/test_decode_cli.py) then loads those programs from the run's
    compilation cache instead of compiling them again."""
    out, png = tmp_path / "forward.json", tmp_path / "forward.png"
    assert main(["forward", "--skip-hf", "--sizes", "1,64", "--repeats", "1", "--context",
                 "128", "--rounds", "1", "--draft-widths", "1,16", "--out", str(out),
                 "--plot", str(png)]) == 0
    assert default_target == [(None, {})]
    result = json.loads(out.read_text())
    assert set(result["forward_ms"]) == {"1", "64"} and result["decode_floor_ms"] > 0
    assert set(result["forward_ms_by_mode"]) <= {"kernel", "matmul kernel", "rows kernel", "xla"}
    assert "xla" in result["forward_ms_by_mode"]
    assert result["compute_floor_ms"]["64"] > result["compute_floor_ms"]["1"] > 0
    assert result["matmul_peak_gflop_s"] > 0 and result["forward_over_floor"]["1"] > 0
    assert set(result["draft_step_ms"]) == {"1", "16"}  # the shipped head's step
    from eagle3_jax.kernels.library import kernels_in_use
    if kernels_in_use("float32", "matmul"):  # the shipped head's bfloat16 values held so
        assert set(result["draft_step_ms_float32_held"]) == {"1", "16"}
    assert result["decode_loop_ms_per_token"] > 0
    assert result["param_bytes"] > 500e6 and png.stat().st_size > 0


def test_bench_prefill_times_both_forms(default_target, tmp_path):
    out, png = tmp_path / "prefill.json", tmp_path / "prefill.png"
    assert main(["prefill", "--lengths", "20,40", "--repeats", "1", "--max-new-tokens", "8",
                 "--out", str(out), "--plot", str(png)]) == 0
    assert default_target == [(None, {})]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["length"], r["bucket"]) for r in rows] == [(20, 32), (40, 64)]
    assert rows[0]["chunk"] is None  # one chunk's width: one forward either way
    for r in rows:
        assert r["one_forward_ms"] > 0 and r["decoders_ms"] > 0 and r["decode_step_ms"] > 0
    assert png.stat().st_size > 0


def test_bench_calibrate_writes_the_scale_into_the_heads_acceptance(default_target,
                                                                   tmp_path):
    """`bench calibrate --write` on a copy of the shipped head: one record per calibration
    tree, the pooled scale, and the copy's acceptance.json gains it (what ``load_head`` reads)."""
    import shutil

    from eagle3_jax.decoding.calibration import CALIBRATION_TREES, accept_scale, fit_live_scale
    from eagle3_jax.draft.load import load_head
    from eagle3_jax.draft.shipped import shipped_head_for

    head = tmp_path / "head"
    shutil.copytree(shipped_head_for(None), head)
    before = json.loads((head / "acceptance.json").read_text())
    before.pop("live", None)
    (head / "acceptance.json").write_text(json.dumps(before))
    out = tmp_path / "calibrate.json"
    assert main(["calibrate", "--draft", str(head), "--num-prompts", "1", "--max-new-tokens",
                 "6", "--write", "--out", str(out)]) == 0
    assert default_target == [(None, {})]
    result = json.loads(out.read_text())
    assert len(result["trees"]) == len(CALIBRATION_TREES)
    assert result["scale"] == pytest.approx(accept_scale(result["trees"]))
    after = json.loads((head / "acceptance.json").read_text())
    assert after["live"] == result and after["hits_per_step"] == before["hits_per_step"]
    loaded = load_head(head)  # the per-level fit of the same trees
    assert (loaded.accept_scale, loaded.accept_decay) == pytest.approx(
        fit_live_scale(result["trees"], loaded.accept_rates))


def test_compute_floor_counts_the_flops_xla_counts():
    """The forward's FLOP count behind the compute floor, against XLA's cost analysis of the
    compiled forward (XLA dots: a custom call has no count) of a small Llama. The count depends
    on shapes alone, so the forward is lowered from the params' and cache's shapes
    (``jax.eval_shape``), without drawing random weights."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax.bench.forward import compute_floor_seconds
    from eagle3_jax.decoding.costs import forward_step
    from eagle3_jax import kernels as rm
    from eagle3_jax.model import KVCache, init_params, to_serving
    from eagle3_jax.model.config import TargetConfig

    cfg = TargetConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                       dtype="float32")
    params = jax.eval_shape(lambda: to_serving(init_params(cfg, jax.random.key(0)), cfg))
    context, t = 24, 8
    cache = jax.eval_shape(
        lambda: KVCache.zeros(cfg, 1, 64).replace(end=jnp.full((1,), context, jnp.int32)))
    previous = rm.set_kernel_enabled(False)
    try:
        compiled = forward_step.lower(params, cache, jnp.ones((1, t), jnp.int32), cfg).compile()
    finally:
        rm.set_kernel_enabled(previous)
    analysis = compiled.cost_analysis()
    xla_flops = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    ours = compute_floor_seconds(cfg, context, t, 1.0)
    # XLA also counts the elementwise work (norms, RoPE, softmax) and attention over all 64
    # slots (ours: the context + t that are read); the matmuls dominate both.
    assert ours == pytest.approx(xla_flops, rel=0.15)


def test_bench_train_reports_throughput_and_memory(smollm2_gguf_path, tmp_path):
    out = tmp_path / "train.json"
    assert main(["train", "--batch-size", "1", "--max-len", "32", "--ttt-steps", "2",
                 "--draft-vocab-size", "1024", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens_per_s"] > 0 and result["peak_rss_mib"] > 0
    assert result["xla_memory"]["argument_mib"] > 500  # the SmolLM2 target is an argument
    flops = result["flops"]
    assert flops["matmul_peak_gflops"] > 0 and flops["head_gflops"] > 0
    assert flops["head_share_of_peak"] == pytest.approx(flops["head_gflops"]
                                                         / flops["matmul_peak_gflops"])


def test_head_flop_count_matches_xla_cost_analysis():
    """The analytic TTT head count against XLA's own count of the compiled forward (one TTT
    step: XLA counts a scan body once). XLA also counts elementwise work (softmax, norms), so
    it may exceed the matmul count by a few percent, never fall below it. The head's params
    enter as shapes (``jax.eval_shape``): the count does not depend on their values."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax.bench.train import head_flops_per_token
    from eagle3_jax.draft.config import DraftConfig
    from eagle3_jax.draft.params import init_draft_params
    from eagle3_jax.draft.ttt import TTTBatch, ttt_forward

    b, t, d, vd = 2, 64, 64, 512
    cfg = DraftConfig(hidden_size=d, intermediate_size=128, num_heads=4, num_kv_heads=2,
                      head_dim=16, vocab_size=1000, draft_vocab_size=vd, tap_layers=(1, 2, 3),
                      ttt_steps=1)
    # Every position scored (masks on): otherwise XLA drops the work that cannot reach the loss.
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros(shape, dtype)  # noqa: E731
    ones = lambda *shape, dtype: jnp.ones(shape, dtype)  # noqa: E731
    batch = TTTBatch(tokens=zeros(b, t, dtype=jnp.int32), taps=zeros(b, t, 3 * d),
                     target_logp=zeros(b, t, vd), target_in_draft=ones(b, t, dtype=bool),
                     loss_mask=ones(b, t, dtype=bool), segment_ids=ones(b, t, dtype=jnp.int32),
                     positions=zeros(b, t, dtype=jnp.int32))
    embed = zeros(1000, d)
    compiled = jax.jit(lambda p: ttt_forward(p, cfg, embed, batch)[0]).lower(
        jax.eval_shape(lambda: init_draft_params(cfg, jax.random.key(0)))).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    ours = head_flops_per_token(cfg, t) / 3 * b * t  # the forward third
    assert ours <= xla <= 1.1 * ours, (ours, xla)


def test_unknown_command_is_refused(capsys):
    assert main(["nope"]) == 2
    assert "usage" in capsys.readouterr().err


def test_bench_speed_measures_the_decoders_defaults(tmp_path, capsys, steady_costs):
    """Without tree flags `bench speed` measures what the decoder does by default: the tree the
    decoder's chooser picks for that prompt, with the fallback (a tiny random target and head,
    the chooser's timings fixed; the head accepts too little, so the long answer gives up
    drafting)."""
    import types

    import jax

    from eagle3_jax.bench.speed import load_questions, main as speed_main
    from eagle3_jax.cli.decode import autotune
    from eagle3_jax.decoding.eagle import RESUME_WINDOW
    from eagle3_jax.draft.export import export_draft_head
    from eagle3_jax.draft.load import load_head
    from eagle3_jax.model.config import TargetConfig
    from eagle3_jax.model.params import init_params, to_serving
    from test_eagle_cli import TINY, ByteTokenizer, random_head

    cfg = TargetConfig(**{**TINY.to_dict(), "max_position_embeddings": 1024})
    target = types.SimpleNamespace(cfg=cfg, params=to_serving(
        init_params(cfg, jax.random.key(3), scale=0.3), cfg), tokenizer=ByteTokenizer(),
        source="tiny-random")
    head = export_draft_head(random_head(cfg, 200, seed=4), tmp_path / "head")
    out = tmp_path / "speed.json"
    assert speed_main(["--tasks", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "40",
                       "--draft", str(head), "--out", str(out), "--no-plot"],
                      load_fn=lambda _: target) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    config = result["config"]
    assert config["total_tokens_auto"] and config["decoder_would_draft"]
    assert config["fallback"] is True and config["resume_window"] == RESUME_WINDOW
    prompt = ByteTokenizer().apply_chat_template(
        [{"role": "user", "content": load_questions("gsm8k", 1)[0][0]}])
    chosen = autotune(target, load_head(head, cfg).serving(), len(prompt), None, None, None).tree
    assert config["tree"] == {"tree_top_k": chosen.tree_top_k, "depth": chosen.depth,
                              "total_tokens": chosen.total_tokens}
    assert result["tasks"]["gsm8k"]["fell_back"] == 1
