"""``python -m eagle3_jax.plan``: a training step compiled ahead of time for a Cloud TPU
topology through libtpu (no TPU here; found in ``<venv>/libtpu``, where ``make setup`` puts it,
or ``$EAGLE3_JAX_LIBTPU_SITE``), or, without libtpu, an analytic estimate whose sizes are those
of ``jax.eval_shape``; and launch/train_tpu.sh refusing a plan that does not fit before it
creates anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from eagle3_jax import plan
from eagle3_jax.model.params import init_params
from eagle3_jax.presets import load_preset

REPO = Path(__file__).resolve().parents[1]
LIBTPU_SITE = plan.libtpu_site()
DEFAULT_SITE = plan.venv_libtpu_site()


def _plan(*args, libtpu: bool):
    """The plan CLI in a fresh process; with ``libtpu`` it finds libtpu by itself (the
    environment names it only where it is not the venv's own), without it none."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTHONPATH", plan.LIBTPU_SITE_ENV)}
    if not libtpu:
        env[plan.LIBTPU_SITE_ENV] = ""
    elif LIBTPU_SITE != DEFAULT_SITE:
        env[plan.LIBTPU_SITE_ENV] = str(LIBTPU_SITE)
    return subprocess.run([sys.executable, "-m", "eagle3_jax.plan", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_libtpu_is_found_in_the_venv_unless_the_environment_names_another(tmp_path,
                                                                          monkeypatch):
    monkeypatch.delenv(plan.LIBTPU_SITE_ENV, raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert plan.libtpu_site() is None  # no <venv>/libtpu
    (tmp_path / "libtpu" / "libtpu").mkdir(parents=True)
    assert plan.libtpu_site() == tmp_path / "libtpu"
    monkeypatch.setenv(plan.LIBTPU_SITE_ENV, "/elsewhere")
    assert plan.libtpu_site() == Path("/elsewhere")
    monkeypatch.setenv(plan.LIBTPU_SITE_ENV, "")
    assert plan.libtpu_site() is None


@pytest.mark.slow
@pytest.mark.skipif(LIBTPU_SITE is None,
                    reason="no libtpu in <venv>/libtpu (make setup installs it) or "
                           "$EAGLE3_JAX_LIBTPU_SITE")
def test_compiled_plans_fit_or_refuse():
    out = _plan("--config", "train-smollm2-135m", "--topology", "v5e-8", "batch_size=8",
                "--json", libtpu=True)
    assert out.returncode == 0, out.stderr[-2000:]
    p = json.loads(out.stdout)
    assert p["method"] == "compiled" and p["fits"] is True and p["devices"] == 8
    assert p["hbm_capacity_bytes"] == 16 * 2**30
    assert 0 < p["hbm_per_chip_bytes"] == sum(p["breakdown"].values()) < p["hbm_capacity_bytes"]
    # At least the frozen target's bfloat16... here float32 weights, split over the data axis'
    # replicas: each chip holds all of them (data parallel), so arguments >= the weights.
    cfg = load_preset("smollm2-135m").target
    assert p["breakdown"]["arguments"] >= cfg.num_params * 4
    assert p["flops"] > 2 * cfg.num_params * 8 * 512  # more than the target's forward
    # Decoding: the verification forward over a full cache, on the plan's (data, tensor) mesh.
    out = _plan("--config", "train-smollm2-135m", "--topology", "v5e-8", "--decode", "--json",
                libtpu=True)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    assert d["method"] == "compiled" and d["fits"] and d["mode"] == "decode"
    assert d["mesh"]["data"] * d["mesh"]["tensor"] == 8 and d["flops"] > 0
    assert d["breakdown"]["arguments"] >= cfg.num_params * 4 / d["mesh"]["tensor"]
    # 4096 sequences a step do not fit eight 16 GiB chips: XLA refuses to allocate the step's
    # temporaries, exit status 1.
    out = _plan("--config", "train-smollm2-135m", "--topology", "v5e-8", "batch_size=4096",
                "--json", libtpu=True)
    assert out.returncode == 1, out.stderr[-2000:]
    p = json.loads(out.stdout)
    assert p["method"] == "compiled" and p["fits"] is False
    assert p["hbm_per_chip_bytes"] > p["hbm_capacity_bytes"] and "RESOURCE_EXHAUSTED" in p["note"]


def test_without_libtpu_the_estimate_is_analytic_and_sized_by_eval_shape():
    out = _plan("--config", "train-llama-3.1-8b-instruct", "--topology", "v5p-16", "--json",
                libtpu=False)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    p = json.loads(out.stdout)
    assert p["method"] == "analytic" and "install libtpu" in p["note"]
    assert {"fits", "hbm_per_chip_bytes", "hbm_capacity_bytes", "flops"} <= set(p)
    cfg = load_preset("llama-3.1-8b-instruct").target
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    assert p["chips"] == 8 and p["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert p["breakdown"]["target"] == weight_bytes / 8
    assert p["hbm_capacity_bytes"] == 95 * 2**30


def test_bad_topology_is_one_line():
    out = _plan("--config", "train-smollm2-135m", "--topology", "v9-8", libtpu=False)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown TPU topology 'v9-8'" in out.stderr


def test_launch_refuses_a_plan_that_does_not_fit_before_creating_anything():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["PY"] = sys.executable
    env[plan.LIBTPU_SITE_ENV] = ""  # the analytic plan suffices to be refused
    out = subprocess.run(["bash", str(REPO / "launch" / "train_tpu.sh"), "--dry-run", "--name",
                          "x", "--zone", "z", "--accelerator", "v5e-8", "--", "--config",
                          "train-llama-3.3-70b-instruct", "target=/mnt/llama33"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "does not fit v5e-8" in out.stderr
    assert not any(line.startswith("+ ") for line in out.stdout.splitlines())  # nothing ran
