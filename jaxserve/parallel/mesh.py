"""The device mesh: one `jax.sharding.Mesh` with axes ("data", "model") built from the parallel flags.

    devices (dp * tp of them)      mesh.devices: [data, model]
    d0 d1 d2 d3                    [[d0, d1],     replica 0: tensor parallel over d0, d1
                                    [d2, d3]]     replica 1: tensor parallel over d2, d3

The "model" axis carries tensor parallelism (weights and the KV pool are split
over it); the "data" axis indexes independent engine replicas, each of which
runs on its own row (`replica_meshes`). Pipeline stages are one such mesh each (pipeline.py).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"
AXIS_NAMES = (DATA_AXIS, MODEL_AXIS)


def check_parallel_config(tensor_parallel_size: int, data_parallel_size: int, pipeline_parallel_size: int,
                          num_devices: int) -> None:
    """Raise ValueError, saying what to use instead, unless the sizes fit `num_devices` devices."""
    for name, size in (("tensor", tensor_parallel_size), ("data", data_parallel_size),
                       ("pipeline", pipeline_parallel_size)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"--{name}-parallel-size must be a positive integer; got {size!r}")
    world = tensor_parallel_size * data_parallel_size * pipeline_parallel_size
    if world > num_devices:
        pp = f" x --pipeline-parallel-size {pipeline_parallel_size}" if pipeline_parallel_size > 1 else ""
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} x --data-parallel-size "
                         f"{data_parallel_size}{pp} needs {world} devices but only {num_devices} are visible")
    if num_devices % world and pipeline_parallel_size == 1:
        fits = [n for n in range(1, num_devices + 1) if num_devices % n == 0]
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} x --data-parallel-size "
                         f"{data_parallel_size} = {world} does not divide the {num_devices} visible devices; "
                         f"use a product in {fits}, or make fewer devices visible "
                         f"(e.g. CUDA_VISIBLE_DEVICES)")


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None, pipeline_parallel_size: int = 1) -> Mesh:
    """A ("data", "model") mesh of shape (data_parallel_size, tensor_parallel_size).

    Uses the first dp * tp of `devices` (default `jax.devices()`), in order, so a
    replica's tensor-parallel group is a run of neighbouring devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    check_parallel_config(tensor_parallel_size, data_parallel_size, pipeline_parallel_size, len(devices))
    world = tensor_parallel_size * data_parallel_size
    grid = np.array(devices[:world], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, AXIS_NAMES)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, tp) mesh per data-parallel replica: the devices each engine replica runs on."""
    return [Mesh(mesh.devices[i:i + 1], AXIS_NAMES) for i in range(mesh.shape[DATA_AXIS])]


def tensor_parallel_size(mesh: Mesh) -> int:
    return mesh.shape[MODEL_AXIS]
