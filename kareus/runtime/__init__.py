"""The real-GPU runtime: the ``cuda`` hardware backend, comm backends, the plan executor, and the
megatron-core layer spec that runs a plan's partitions (``layer_spec``, ``PlanRuntime``).

Importing this package registers ``cuda`` in HARDWARE and ``nccl``/``gloo``/``copy``/``mscclpp`` in
COMM_BACKENDS without importing torch (every module imports torch, NVML, Zeus and megatron-core
inside functions), so the planner and config validation can see the runtime's schemas on any install.
"""
from kareus.runtime.backend import CudaBackend, CudaConfig, launch_points
from kareus.runtime.comm import CopyBackend, CopyConfig, GlooBackend, GlooConfig, NCCLBackend, NCCLConfig
from kareus.runtime.mscclpp_comm import MscclppBackend, MscclppConfig
from kareus.runtime.executor import PlanCoverageError, PlanExecutor, Switch
from kareus.runtime.partitioned import PlanLayoutError, PlanRuntime, layer_spec

__all__ = [
    "CopyBackend", "CopyConfig", "CudaBackend", "CudaConfig", "GlooBackend", "GlooConfig", "NCCLBackend",
    "MscclppBackend", "MscclppConfig", "NCCLConfig", "PlanCoverageError", "PlanExecutor", "PlanLayoutError", "PlanRuntime", "Switch", "launch_points",
    "layer_spec",
]
