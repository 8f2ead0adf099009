"""One process of a multi-process training run (used by test_multihost.py).

    python tests/multihost_worker.py OUT_DIR NUM_PROCESSES PROCESS_ID COORDINATOR DEVICES

Sets the number of emulated CPU devices before JAX starts, joins the job, trains the tiny
target of test_train.py for a few steps on a (data, fsdp, tensor) = (2, 2, 2) mesh and, on
process 0, writes the per-step losses to OUT_DIR/losses.json.
"""

import json
import os
import sys
from pathlib import Path

out_dir, num_processes, process_id, coordinator, devices = sys.argv[1:6]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from xla_flags import with_devices  # noqa: E402

os.environ["XLA_FLAGS"] = with_devices(os.environ.get("XLA_FLAGS", ""), int(devices))

import jax  # noqa: E402

from eagle3_jax.sharding import MeshConfig  # noqa: E402
from eagle3_jax.train.distributed import initialize  # noqa: E402
from eagle3_jax.train.loop import train  # noqa: E402
from test_train import run_config, synthetic_records, tiny_target  # noqa: E402

if int(num_processes) > 1:
    initialize("explicit", coordinator, int(num_processes), int(process_id))
assert jax.device_count() == 8, jax.device_count()
cfg = run_config(Path(out_dir) / "run", mesh=MeshConfig(data=2, fsdp=2, tensor=2), total_steps=6,
                 save_every=3, eval_every=6, eval_batches=1)
summary = train(cfg, target_override=tiny_target(), train_records=synthetic_records())
if jax.process_index() == 0:
    (Path(out_dir) / "losses.json").write_text(json.dumps(
        {"losses": summary["losses"], "eval": summary["eval"]["acc_per_step"]}))
