"""Hardware backends: the simulated GPU (``sim``, the default) and the table replay (``replay``)."""
from kareus.hardware.base import GPUSpec, HardwareBackend
from kareus.hardware.replay import ReplayBackend, ReplayConfig, TableError, load_table
from kareus.hardware.sim import SimulatedGPU
from kareus.hardware.sim_config import SimConfig
from kareus.hardware.spec import GPUConfig

__all__ = ["GPUConfig", "GPUSpec", "HardwareBackend", "ReplayBackend", "ReplayConfig", "SimConfig",
           "SimulatedGPU", "TableError", "load_table"]
