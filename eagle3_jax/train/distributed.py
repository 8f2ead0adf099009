"""Multi-host start-up: ``jax.distributed.initialize`` from flags or environment.

On a Cloud TPU VM slice every worker runs the same command and JAX discovers the coordinator
itself (``--distributed auto``). Elsewhere (several CPU processes on one machine, a GPU cluster)
name the coordinator, the process count and this process's id, by flags or by the environment
variables ``EAGLE3_JAX_COORDINATOR``, ``EAGLE3_JAX_NUM_PROCESSES``, ``EAGLE3_JAX_PROCESS_ID``.
Call this before anything touches a JAX device.
"""

from __future__ import annotations

import logging
import os

import jax

from eagle3_jax.model.config import ConfigError

log = logging.getLogger(__name__)

ENV_COORDINATOR = "EAGLE3_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "EAGLE3_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "EAGLE3_JAX_PROCESS_ID"


def initialize(mode: str = "off", coordinator: str | None = None,
               num_processes: int | None = None, process_id: int | None = None) -> bool:
    """Join a multi-process JAX job. Returns True when one was joined.

    mode: "off" (single process unless the environment names a coordinator), "auto" (let JAX
      discover the cluster: Cloud TPU, SLURM, ...), or "explicit" (coordinator, count and id
      must be given, here or in the environment).
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if mode == "off" and coordinator is None:
        return False
    if mode == "auto" and coordinator is None:
        jax.distributed.initialize()
    else:
        if coordinator is None or num_processes is None or process_id is None:
            raise ConfigError(
                "multi-process training needs a coordinator address, the number of processes and "
                f"this process's id: pass --coordinator HOST:PORT --num-processes N --process-id I "
                f"or set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"process id {process_id} must be in [0, {num_processes})")
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id)
    log.info("process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True
