"""Compiling for GPUs this machine does not have: XLA's "deviceless" compile, given the GPU's description.

With JAX's CUDA plugin installed (`pip install jax-cuda13-plugin jax-cuda13-pjrt` at jax's version, no CUDA
libraries and no driver needed), XLA compiles a step for an H100 or H200 on a CPU-only machine: the same
fusions, library calls, collectives and buffer assignment a GPU's compile makes, except the choices a GPU
would time (autotuning), which take XLA's defaults. The planner reads its kernels and memory from that
program (kernel_cost.py) rather than from a compile for CPU devices.

Runs in the plan's worker process, before and after jax is imported (`prepare` first).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, List, Optional, Tuple

# What XLA needs to know of each GPU to compile for it: the values the CUDA device query and nvidia-smi
# report for the lent cards (H100 SXM 80GB and H200 SXM 141GB share the GH100 die: 132 SMs, 50 MiB L2).
_GH100 = """
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  l2_cache_size: 52428800 clock_rate_ghz: 1.98 shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  memory_bandwidth: {bandwidth} device_memory_size: {memory}
"""
TARGETS = {
    # name: (device description, HBM bytes/s by the datasheet, memory bytes as CUDA reports them)
    "h100": ("NVIDIA H100 80GB HBM3", 3352320000000, 84929347584),
    "h200": ("NVIDIA H200", 4800000000000, 150754820096),
}
PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def compiler_dir() -> str:
    """Where the plan looks for JAX's CUDA plugin beside this Python's own packages: a folder of its own,
    because a CUDA plugin installed into the environment makes every jax import on a machine without a
    GPU print a failed attempt to load CUDA."""
    return os.environ.get("ALPA_JOB_GPU_COMPILER") or os.path.join(os.path.expanduser("~"), ".cache", "alpa_job", "gpu-compiler")


def install_hint() -> str:
    import jax

    v = jax.__version__
    return (
        f"pip install --no-deps --target {compiler_dir()} 'jax-cuda13-plugin=={v}' 'jax-cuda13-pjrt=={v}' "
        "(about 400 MB; no CUDA libraries or GPU needed)"
    )


def activate() -> None:
    """Make the plugin in compiler_dir() importable (this process only)."""
    folder = compiler_dir()
    if os.path.isdir(folder) and folder not in sys.path:
        sys.path.append(folder)


def plugin() -> Optional[str]:
    """The CUDA plugin module this Python can import (with compiler_dir()), or None."""
    activate()
    for name in PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def supported(gpu_name: str) -> bool:
    return gpu_name in TARGETS


def target_config(gpu_name: str) -> str:
    """XLA's GpuTargetConfig (text proto) for a catalogue GPU."""
    description, bandwidth, memory = TARGETS[gpu_name]
    return (
        "gpu_device_info {\n"
        + _GH100.format(bandwidth=bandwidth, memory=memory)
        + "}\n"
        + 'platform_name: "CUDA"\n'
        + "dnn_version_info { major: 9 minor: 8 }\n"
        + "runtime_version { major: 13 minor: 0 }\n"
        + f'device_description_str: "{description}"\n'
    )


def prepare() -> None:
    """Before jax starts its backends: there is no driver to report CUDA's version and no GPU to open."""
    activate()
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"


CUDNN_VERSION = 90800  # the cuDNN the target configs above declare (dnn_version_info 9.8)


def present_as_gpu() -> None:
    """Models that pick a form by platform (fused cuDNN attention on a GPU, a plain form elsewhere) trace as
    they would on the GPU the plan compiles for: this worker process reports "gpu" as jax's backend, and
    jax's fused attention reads the cuDNN version the target declares instead of loading a cuDNN library
    that a machine without a GPU need not have."""
    import jax

    jax.default_backend = lambda: "gpu"
    try:
        from jax._src.cudnn import fused_attention_stablehlo
    except ImportError:  # another jax: its attention then checks as it does
        return
    fused_attention_stablehlo.check_cudnn_version = lambda: CUDNN_VERSION


def devices(gpu_name: str, count: int) -> List[Any]:
    """`count` devices of `gpu_name` for jax meshes, compiled for and never run on."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(gpu_name), topology=f"1x1x{count}")
    return list(topology.devices)


def mesh(device_list: List[Any], shape: Tuple[int, int], axis_names: Tuple[str, str]):
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.asarray(device_list).reshape(shape), axis_names)
