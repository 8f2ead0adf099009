"""``python -m eagle3_jax.export --checkpoint RUN_DIR [--step N] --out DIR [--dtype bfloat16]
[--format sglang|reference|speculators] [--verifier HF_ID]``

Writes a training run's draft head in a published EAGLE-3 layout (``config.json`` +
``model.safetensors``, reference §6; ``eagle3_jax.draft.export``): ``sglang`` (the default:
SGLang / SpecForge, also read by vLLM and ``eagle3_jax.draft.load.load_head``), ``reference``
(SafeAILab/EAGLE) or ``speculators`` (vLLM's, naming the target as its verifier: ``--verifier``,
default the run's target). A head a layout cannot describe is refused, naming why. Beside them, ``acceptance.json``: the run's held-out eval at that
step (per-depth top-r hit rates, what ``--total-tokens auto`` models trees from).

``--card TITLE`` also writes ``README.md``, the head's model card (``eagle3_jax.draft.card``),
from the run's records, ``--build-info JSON`` (data counts, hardware, the rebuild command) and
any ``--results NAME=bench_speed.json`` reports.
"""

from __future__ import annotations

import argparse
import json
import sys

from eagle3_jax.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a training run's out_dir (or its checkpoints/<step> folder)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--out", required=True, help="output folder for the head")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="weight dtype (default: the run's)")
    parser.add_argument("--format", default="sglang", choices=("sglang", "reference", "speculators"),
                        help="the layout to write (default sglang)")
    parser.add_argument("--verifier", default=None, metavar="HF_ID",
                        help="with --format speculators: the target's HF id or path (default: "
                             "the run's target)")
    parser.add_argument("--card", metavar="TITLE", default=None,
                        help="also write README.md, the model card, with this title")
    parser.add_argument("--build-info", metavar="JSON", default=None,
                        help="with --card: JSON of data / hardware / notes / command lines")
    parser.add_argument("--results", metavar="NAME=JSON", action="append", default=[],
                        help="with --card: a `bench speed` report to include (repeatable)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        from pathlib import Path

        from eagle3_jax.draft.export import export_draft_head, weights_digest
        from eagle3_jax.draft.load import (ACCEPTANCE_FILE, METRICS_FILE, HeadError,
                                           check_head_path, latest_eval, load_head)

        if (check_head_path(args.checkpoint) / "config.json").is_file():
            raise HeadError(f"--checkpoint {args.checkpoint} is already a released-format head; "
                            "give a training run's out_dir")
        results = []
        for item in args.results:
            name, _, path = item.rpartition("=")  # the name may hold "=" (T=0)
            if not path or not Path(path).is_file():
                raise HeadError(f"--results takes NAME=PATH of a bench speed JSON, got {item!r}")
            results.append((name, json.loads(Path(path).read_text())))
        loaded = load_head(args.checkpoint, step=args.step)
        run_dir = loaded.run_dir
        verifier = _verifier(args.verifier, run_dir) if args.format == "speculators" else None
        out = export_draft_head(loaded.head, args.out, dtype=args.dtype, format=args.format,
                                verifier=verifier)
        record = latest_eval(run_dir / METRICS_FILE, loaded.step)
        acceptance = out / ACCEPTANCE_FILE
        if record is not None:
            record = {"source": str(run_dir), **record}
            live = _read_live(acceptance)
            if live is not None and live.get("weights_sha256") == weights_digest(out):
                record["live"] = live  # `bench calibrate` of these very weights
            acceptance.write_text(json.dumps(record, indent=1) + "\n")
        elif acceptance.exists():
            acceptance.unlink()  # stale: from another head
        if args.card:
            from eagle3_jax.draft.card import model_card

            build = json.loads(Path(args.build_info).read_text()) if args.build_info else None
            card = model_card(run_dir, loaded.step, loaded.head.cfg, title=args.card,
                              weights_dtype=args.dtype or loaded.head.cfg.dtype, build=build,
                              results=results, live=(record or {}).get("live"))
            (out / "README.md").write_text(card)
        print(f"wrote the step-{loaded.step} draft head of {args.checkpoint} to {out}")

    return run_cli(body, debug=args.debug)


def _read_live(acceptance) -> dict | None:
    """The ``"live"`` calibration of an existing ``acceptance.json``, or None."""
    try:
        return json.loads(acceptance.read_text()).get("live")
    except (OSError, ValueError, AttributeError):
        return None


# HF architecture names of our target families (a speculators config names its verifier's).
# (Gemma 3's 4B-27B checkpoints are Gemma3ForConditionalGeneration: pass --verifier for those.)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma3": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "mixtral": "MixtralForCausalLM"}


def _verifier(name: str | None, run_dir) -> dict:
    """{"name_or_path", "architectures"} of the run's target: ``name`` or the run's
    ``target``, its architecture from the preset when there is one."""
    import yaml

    target = None
    config = run_dir / "train_config.yaml" if run_dir is not None else None
    if config is not None and config.is_file():
        target = (yaml.safe_load(config.read_text()) or {}).get("target")
    architectures = []
    if target:
        from eagle3_jax.presets import PresetError, load_preset

        try:
            architectures = [HF_ARCHITECTURES[load_preset(str(target)).target.arch]]
        except PresetError:  # a path or an HF folder, not a preset: leave it unnamed
            architectures = []
    return {"name_or_path": name or target, "architectures": architectures}


if __name__ == "__main__":
    sys.exit(main())
