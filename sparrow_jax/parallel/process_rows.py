"""Process-local rows of a global batch: each process samples, scores and holds its own rows.

On several processes the RL step's batch [B, ...] is split over rows on ("data", "fsdp"); the
devices of one process hold one contiguous block of rows. Rather than every process sampling
all B rows and gathering them (what a global jitted sampler plus ``host_array`` does), each
process samples the prompts of its block on its own devices, scores them where they are, and
the train step's batch is assembled from the blocks with
``jax.make_array_from_process_local_data``: the only cross-process traffic is the gather of a
few numbers per row for logging (:func:`gather_rows`).
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sparrow_jax.parallel.sharding import batch_spec


def _row_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(shape, mesh))


def process_rows(mesh: Optional[Mesh], num_rows: int, group: int = 1) -> tuple[int, int]:
    """The block ``[start, stop)`` of a [num_rows, ...] batch that this process's devices hold.

    ``(0, num_rows)`` on one process, without a mesh, or when the rows are not split (every
    process holds them all). ``group``: rows come in groups (the G samples of a prompt) that
    must not straddle processes; ValueError naming the sizes otherwise.
    """
    if mesh is None or jax.process_count() == 1:
        return 0, num_rows
    index_map = _row_sharding(mesh, (num_rows,)).addressable_devices_indices_map((num_rows,))
    rows = sorted({r for index in index_map.values() for r in range(*index[0].indices(num_rows))})
    start, stop = rows[0], rows[-1] + 1
    if len(rows) != stop - start:
        raise ValueError(f"this process holds rows {rows} of the batch, not one block; place each process's "
                         f"devices together along the mesh's ('data', 'fsdp') axes")
    if start % group or stop % group:
        raise ValueError(f"process {jax.process_index()} holds rows [{start}, {stop}) of {num_rows}, which splits "
                         f"groups of {group} samples; make rollout.prompts_per_step a multiple of the processes")
    return start, stop


def rows_to_global(local: np.ndarray, mesh: Mesh, num_rows: int) -> jax.Array:
    """The global [num_rows, ...] array whose rows :func:`process_rows` are ``local`` on every
    process (each passes its own block; every process calls it)."""
    local = np.asarray(local)
    shape = (num_rows,) + local.shape[1:]
    return jax.make_array_from_process_local_data(_row_sharding(mesh, shape), local, shape)


def gather_rows(local: np.ndarray) -> np.ndarray:
    """Every process's ``local`` host rows, concatenated in process order (every process calls it,
    with a block of the same shape)."""
    if jax.process_count() == 1:
        return np.asarray(local)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))
