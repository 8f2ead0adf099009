"""Multi-host training: 2 processes (jax.distributed on localhost) x 4 CPU devices train to the
same losses as 1 process x 8 devices: same global batches, same sharded step."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # three JAX processes, each compiling the training step

WORKER = Path(__file__).resolve().parent / "multihost_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(out_dir: Path, num_processes: int, devices: int) -> dict:
    out_dir.mkdir(parents=True)
    coordinator = f"localhost:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out_dir), str(num_processes),
                               str(i), coordinator, str(devices)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(num_processes)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return json.loads((out_dir / "losses.json").read_text())


def test_two_processes_equal_one_process(tmp_path):
    one = _launch(tmp_path / "one", num_processes=1, devices=8)
    two = _launch(tmp_path / "two", num_processes=2, devices=4)
    assert len(one["losses"]) == 6
    # Same batches and math; only the order of cross-device sums may differ.
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(two["eval"], one["eval"], atol=1e-6)
