"""The device mesh of a run: three named axes built from the config's ``mesh`` fields.

``config.mesh = {data, fsdp, tensor}`` (configs/common.py) becomes a
``jax.sharding.Mesh`` of shape ``(data, fsdp, tensor)`` with axis names
``("data", "fsdp", "tensor")``:

* ``data``   pure data parallelism: batch rows split, parameters replicated;
* ``fsdp``   batch rows split *and* parameters / optimizer state split along one dim
             (ZeRO-3 style; XLA inserts the all-gathers and reduce-scatters);
* ``tensor`` attention heads and MLP intermediate units split (Megatron style).

The axes are ``AxisType.Auto``: jit propagates shardings from its inputs (GSPMD), so
model and train-step code stays free of sharding annotations. (jax >= 0.7 defaults
``jax.make_mesh`` to ``Explicit`` axes, which would require sharding-aware model code.)
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

AXES = ("data", "fsdp", "tensor")  # mesh axis names, outermost (slowest links) first
BATCH_AXES = ("data", "fsdp")  # axes that split batch rows


def _field(mesh_cfg: Any, name: str) -> Any:
    if isinstance(mesh_cfg, Mapping):
        if name not in mesh_cfg:
            raise ValueError(f"config field mesh.{name} is missing; the mesh needs fields {AXES}")
        return mesh_cfg[name]
    if not hasattr(mesh_cfg, name):
        raise ValueError(f"config field mesh.{name} is missing; the mesh needs fields {AXES}")
    return getattr(mesh_cfg, name)


def mesh_shape(mesh_cfg: Any) -> tuple[int, int, int]:
    """(data, fsdp, tensor) from a MeshSpec / dict / object with those fields, each an int >= 1."""
    shape = []
    for name in AXES:
        value = _field(mesh_cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config field mesh.{name} must be an int >= 1, got {value!r}")
        shape.append(value)
    return tuple(shape)


def make_mesh(mesh_cfg: Any, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """Mesh ``(data, fsdp, tensor)`` over ``devices`` (default: all devices of all processes).

    The product of the three fields must equal the number of devices, else ValueError
    naming the fields and the device count. Device order comes from ``jax.make_mesh``
    (topology-aware on TPU: ``tensor``, the innermost axis, gets the fastest links).
    """
    shape = mesh_shape(mesh_cfg)
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(shape) != len(devices):
        fields = " x ".join(f"mesh.{n}={s}" for n, s in zip(AXES, shape))
        raise ValueError(f"config fields {fields} ask for {math.prod(shape)} devices, but the mesh gets "
                         f"{len(devices)} (jax.device_count() = {jax.device_count()}); set the mesh fields "
                         f"so that their product is {len(devices)}")
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def make_abstract_mesh(mesh_cfg: Any) -> AbstractMesh:
    """Device-free mesh of the same shape: plan shardings (e.g. specs, memory) without the devices."""
    return AbstractMesh(mesh_shape(mesh_cfg), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axis_size(mesh: Mesh | AbstractMesh, axes: str | Sequence[str] | None) -> int:
    """Number of devices a spec entry (an axis name, a tuple of names or None) splits over."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    sizes = dict(mesh.shape)
    return math.prod(sizes[a] for a in axes)
