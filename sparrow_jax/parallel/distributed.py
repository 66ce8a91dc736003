"""Multi-host start-up: ``jax.distributed.initialize`` only when a run is configured for it.

JAX runs one Python process per host (multi-controller): every process executes the same
program on the same global arrays and owns the shards on its local devices. Call
:func:`initialize_distributed` first thing in ``main`` (before any other JAX call); it is a
no-op for single-process runs, so the same entry point serves a laptop and a pod.

Configuration, explicit arguments first, then environment variables:

    coordinator_address  JAX_COORDINATOR_ADDRESS   "host:port" of process 0
    num_processes        JAX_NUM_PROCESSES         total processes (usually one per host)
    process_id           JAX_PROCESS_ID            this process, 0 .. num_processes - 1
    auto                 SPARROW_DISTRIBUTED=auto  let JAX detect the cluster (Cloud TPU
                                                   pod slices, SLURM, Open MPI, Kubernetes)

With none of them set, nothing is initialised (single process). ``num_processes`` and
``process_id`` come together; with only the coordinator address given, JAX's cluster
detection fills them in.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

import jax
import numpy as np

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_MODE = "SPARROW_DISTRIBUTED"
_AUTO = ("auto", "1", "true", "yes")
_OFF = ("", "0", "false", "no", "off")


def _int_env(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def distributed_settings(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                         process_id: Optional[int] = None, auto: Optional[bool] = None,
                         env: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """The keyword arguments for ``jax.distributed.initialize``, or None when not configured.

    Pure (reads ``env``, default ``os.environ``; touches no JAX state), so it is testable.
    Raises ValueError naming the argument / variable when the settings are inconsistent.
    """
    env = os.environ if env is None else env
    mode = env.get(ENV_MODE, "").strip().lower()
    if mode not in _AUTO + _OFF:
        raise ValueError(f"environment variable {ENV_MODE} must be 'auto' or unset/0, got {env.get(ENV_MODE)!r}")
    address = coordinator_address or env.get(ENV_ADDRESS, "").strip() or None
    num = num_processes if num_processes is not None else _int_env(env, ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _int_env(env, ENV_PROCESS_ID)
    auto = (mode in _AUTO) if auto is None else auto
    if address is None and num is None and pid is None:
        return {} if auto else None
    if (num is None) != (pid is None):
        raise ValueError(f"num_processes ({ENV_NUM_PROCESSES}) and process_id ({ENV_PROCESS_ID}) go together; "
                         f"got num_processes={num}, process_id={pid}")
    if num is not None:
        if num < 1:
            raise ValueError(f"num_processes ({ENV_NUM_PROCESSES}) must be >= 1, got {num}")
        if not 0 <= pid < num:
            raise ValueError(f"process_id ({ENV_PROCESS_ID}) must be in [0, {num}), got {pid}")
        if address is None and num > 1:
            raise ValueError(f"num_processes={num} needs coordinator_address ({ENV_ADDRESS}), "
                             f"the host:port of process 0")
    kwargs = {"coordinator_address": address}
    if num is not None:
        kwargs.update(num_processes=num, process_id=pid)
    return kwargs


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, auto: Optional[bool] = None) -> bool:
    """Initialise JAX's multi-controller runtime if configured (see module doc). Returns True if it is on.

    Idempotent: a second call (or one after JAX was initialised elsewhere) does nothing.
    Must run before anything queries devices (``jax.devices()``, the first jit, ...).
    """
    settings = distributed_settings(coordinator_address, num_processes, process_id, auto)
    if jax.distributed.is_initialized():
        return True
    if settings is None:
        return False
    if settings.get("num_processes") == 1 and not settings.get("coordinator_address"):
        return False  # one process: nothing to coordinate
    jax.distributed.initialize(**settings)
    return True


def host_array(x: jax.Array) -> np.ndarray:
    """A global array's full value on this host: a plain read when this process holds every
    shard, else an explicit all-gather across processes (every process must call it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def is_primary() -> bool:
    """True on process 0, the only process that writes logs, reports and plots."""
    return jax.process_index() == 0


def process_info() -> dict:
    """Where this process sits in the run (for the start-up log line)."""
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "local_devices": jax.local_device_count(), "devices": jax.device_count(),
            "platform": jax.devices()[0].platform}
