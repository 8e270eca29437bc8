"""The real-GPU runtime: the ``cuda`` hardware backend, comm backends, and the plan executor.

Importing this package registers ``cuda`` in HARDWARE and ``nccl``/``gloo``/``copy`` in
COMM_BACKENDS without importing torch (every module imports torch, NVML, Zeus and megatron-core
inside functions), so the planner and config validation can see the runtime's schemas on any install.
"""
from kareus.runtime.backend import CudaBackend, CudaConfig, launch_points
from kareus.runtime.comm import CopyBackend, CopyConfig, GlooBackend, GlooConfig, NCCLBackend, NCCLConfig
from kareus.runtime.executor import PlanCoverageError, PlanExecutor, Switch

__all__ = [
    "CopyBackend", "CopyConfig", "CudaBackend", "CudaConfig", "GlooBackend", "GlooConfig", "NCCLBackend",
    "NCCLConfig", "PlanCoverageError", "PlanExecutor", "Switch", "launch_points",
]
