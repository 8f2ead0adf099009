"""launch/train_tpu.sh --dry-run prints the gcloud commands of a multi-host run without running
them; bad arguments fail with a message."""

import os
import subprocess
from pathlib import Path

from eagle3_jax.plan import LIBTPU_SITE_ENV

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "train_tpu.sh"


def _run(*args):
    # The plan the script runs first is the analytic one (libtpu hidden): these tests are about
    # the commands it prints; tests/test_plan.py compiles plans through libtpu.
    env = dict(os.environ, **{LIBTPU_SITE_ENV: ""})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_dry_run_prints_create_install_and_train_on_all_workers():
    out = _run("--dry-run", "--name", "eagle3-test", "--zone", "us-east5-a", "--accelerator",
               "v5p-32", "--project", "proj", "--", "--config",
               "configs/train-llama-3.1-8b-instruct.yaml", "total_steps=10")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("+ ")]
    assert "tpu-vm create eagle3-test --zone us-east5-a --project proj --accelerator-type v5p-32" \
        in lines[0]
    assert any("git -C" in line and "archive" in line for line in lines)
    assert any("tpu-vm scp" in line and "--worker=all" in line for line in lines)
    install = [line for line in lines if "pip\\ install" in line]
    assert install and "--worker=all" in install[0] and "\\[tpu\\]" in install[0]
    train = lines[-1]
    assert "--worker=all" in train and "eagle3_jax.train\\ --distributed\\ auto" in train
    assert "train-llama-3.1-8b-instruct.yaml\\ total_steps=10" in train


def test_missing_arguments_are_refused():
    out = _run("--dry-run", "--name", "x", "--zone", "z")
    assert out.returncode == 2 and "--accelerator is required" in out.stderr
    out = _run("--dry-run", "--name", "x", "--zone", "z", "--accelerator", "v5e-8")
    assert out.returncode == 2 and "training arguments after --" in out.stderr


def test_exec_runs_one_job_on_worker_0_and_every_job_logs_per_worker():
    out = _run("--dry-run", "--name", "x", "--zone", "z", "--accelerator", "v5p-32", "--exec",
               "python -m eagle3_jax.bench speed --target /mnt/l --draft /mnt/h")
    assert out.returncode == 0, out.stderr
    last = out.stdout.splitlines()[-1]
    assert "--worker=0" in last and "eagle3_jax.bench\\\\\\ speed" in last
    assert "tee\\ -a\\ logs/exec-\\$\\(hostname\\).log" in last and "eagle3_jax.train" not in last
    train = _run("--dry-run", "--name", "x", "--zone", "z", "--accelerator", "v5p-32", "--",
                 "--config", "configs/train-llama-3.1-8b-instruct.yaml")
    assert "logs/train-\\$\\(hostname\\).log" in train.stdout.splitlines()[-1]
    both = _run("--dry-run", "--name", "x", "--zone", "z", "--accelerator", "v5p-32", "--exec",
                "true", "--", "--config", "c.yaml")
    assert both.returncode == 2 and "either --exec" in both.stderr
