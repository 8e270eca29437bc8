"""What every stage of a run needs to know, built once from the validated config."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kareus.config.hashing import config_hash
from kareus.hardware.base import GPUSpec
from kareus.types import ModelSpec, ParallelSpec, Partitioning


@dataclass
class RunContext:
    cfg: DictConfig
    typed: dict[str, Any]  # the validated, typed component sections
    run_dir: Path
    gpu: GPUSpec
    model: ModelSpec | None
    parallel: ParallelSpec
    workload: Any | None  # kareus.workload.Workload
    partitioning: Partitioning | None
    config_hash: str
    journal_dir: Path  # where the measurement journal lives (the run dir, or the resumed one)

    @property
    def simulated(self) -> bool:
        """Numbers come from the simulated GPU (and are labelled so)."""
        return self.hardware_name == "sim"

    @property
    def hardware_name(self) -> str:
        return str(self.cfg.hardware.name)

    @property
    def hardware_label(self) -> str:
        """E.g. ``sim:A100-SXM4-40GB``: backend and GPU, for tags and plans."""
        return f"{self.hardware_name}:{self.gpu.name}"

    def section(self, key: str) -> dict[str, Any]:
        """A config section as a plain dict (picklable, for worker processes)."""
        return OmegaConf.to_container(self.cfg[key], resolve=True, enum_to_str=True)  # type: ignore[return-value]


def build_context(cfg: DictConfig, typed: dict[str, Any], run_dir: Path) -> RunContext:
    """Resolve the model and layout, build the workload graph and partition it (no measurement)."""
    from kareus.config.schema import ModelConfig, ParallelConfig
    from kareus.errors import KareusError
    from kareus.registry import PARTITIONERS, to_dataclass
    from kareus.workload import build_workload

    gpu = typed["hardware"].gpu_spec()
    parallel = to_dataclass(ParallelConfig, cfg.parallel).spec()
    model = to_dataclass(ModelConfig, cfg.model).spec() if cfg.get("model") is not None else None
    workload = partitioning = None
    if model is not None:
        workload = build_workload(model, parallel, gpu.gpus_per_node)
        partitioning = PARTITIONERS.build(cfg.partitioner.name, config=typed["partitioner"]).partition(workload)
    journal_dir = run_dir
    if cfg.get("resume"):
        journal_dir = Path(str(cfg.resume)).expanduser()
        if not journal_dir.is_dir():
            raise KareusError(f"resume: {journal_dir} is not a run directory")
    return RunContext(cfg=cfg, typed=typed, run_dir=run_dir, gpu=gpu, model=model, parallel=parallel,
                      workload=workload, partitioning=partitioning, config_hash=config_hash(cfg),
                      journal_dir=journal_dir)

