"""Scale-out with JAX's own runtime: a named device mesh, logical-axis sharding rules, multi-host init.

No distribution layer of our own: inputs (params, optimizer state, batch) are placed with
``NamedSharding`` on a ``("data", "fsdp", "tensor")`` mesh and ``jax.jit`` propagates the
shardings through the unchanged model and train step (GSPMD). The sparse decode kernels,
custom calls GSPMD cannot split, run per device under ``shard_map`` (``kernels.py``).
See docs/scale_out.md.
"""
from sparrow_jax.parallel.distributed import (distributed_settings, host_array, initialize_distributed, is_primary,
                                              process_info)
from sparrow_jax.parallel.kernels import (kernel_mesh, mesh_context, place_kv_caches, place_rows, rows_heads_spec,
                                          shard_rows_and_heads)
from sparrow_jax.parallel.mesh import AXES, BATCH_AXES, axis_size, make_abstract_mesh, make_mesh, mesh_shape
from sparrow_jax.parallel.sharding import (LOGICAL_RULES, abstract_target, batch_shardings, batch_spec,
                                           cache_shardings, cache_spec, describe, logical_to_spec,
                                           mirror_shardings, opt_state_shardings, param_logical_axes,
                                           param_shardings, param_spec, param_specs, shard_batch, shard_caches,
                                           shard_params, shard_to, shard_train_state, train_state_shardings)

__all__ = [
    "AXES", "BATCH_AXES", "LOGICAL_RULES", "abstract_target", "axis_size", "batch_shardings", "batch_spec",
    "cache_shardings", "cache_spec", "describe", "distributed_settings", "host_array", "initialize_distributed",
    "is_primary", "kernel_mesh", "logical_to_spec", "mesh_context", "place_kv_caches", "place_rows",
    "rows_heads_spec", "shard_rows_and_heads", "make_abstract_mesh", "make_mesh", "mesh_shape", "mirror_shardings",
    "opt_state_shardings", "param_logical_axes", "param_shardings", "param_spec", "param_specs",
    "process_info", "shard_batch", "shard_caches", "shard_params", "shard_to", "shard_train_state",
    "train_state_shardings",
]
