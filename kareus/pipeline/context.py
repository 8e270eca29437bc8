"""What every stage of a run needs to know, built once from the validated config."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kareus.config.hashing import config_hash
from kareus.config.paths import from_start_dir
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

    @property
    def simulated(self) -> bool:
        """Numbers come from the simulated GPU (and are labelled so)."""
        return self.hardware_name == "sim"

    @property
    def numbers_kind(self) -> str:
        """How a run's numbers are labelled: ``simulated``, ``replayed`` (a recorded table) or ``""`` (a real GPU)."""
        return {"sim": "simulated", "replay": "replayed"}.get(self.hardware_name, "")

    @property
    def journal_path(self) -> Path:
        """This run's measurement journal (a resumed run continues a copy of the old one here)."""
        from kareus.profiler.journal import journal_path_for

        return journal_path_for(self.run_dir)

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


@dataclass
class _Layout:
    """The model, the parallel layout, the workload graph and its partitions (without a model, a
    replayed table's search, all but the layout are None)."""

    model: ModelSpec | None
    parallel: ParallelSpec
    workload: Any
    partitioning: Partitioning | None


def _layout(cfg: DictConfig, typed: dict[str, Any]) -> _Layout:
    from kareus.config.schema import ModelConfig, ParallelConfig
    from kareus.registry import PARTITIONERS, to_dataclass
    from kareus.workload import build_workload

    parallel = to_dataclass(ParallelConfig, cfg.parallel).spec()
    model = to_dataclass(ModelConfig, cfg.model).spec() if cfg.get("model") is not None else None
    if model is None:
        return _Layout(None, parallel, None, None)
    workload = build_workload(model, parallel, typed["hardware"].gpu_spec().gpus_per_node)
    partitioning = PARTITIONERS.build(cfg.partitioner.name, config=typed["partitioner"]).partition(workload)
    return _Layout(model, parallel, workload, partitioning)


def partition_problems(cfg: DictConfig, typed: dict[str, Any]) -> list[str]:
    """What the workload, its partitions and ``search.space`` rule out before a run starts (a few tens
    of ms): every job of a sweep is checked so before the first one runs. [] without a model (a
    replayed table's partitions are checked once the table is read)."""
    from kareus.search.space import slot_problems

    try:
        layout = _layout(cfg, typed)
    except ValueError as err:  # a layout rule validate() does not know yet
        return [f"parallel: {err}"]
    if layout.partitioning is None:
        return []
    return slot_problems(layout.partitioning.types, typed["search"].space)


def build_context(cfg: DictConfig, typed: dict[str, Any], run_dir: Path,
                  previous_config: bytes | None = None) -> RunContext:
    """Resolve the model and layout, build the workload graph and partition it (no measurement).

    With ``resume``, the old run's journal is checked and copied here before anything is recorded.
    ``previous_config``: the saved config of the run that ``run_dir`` already held, as it was before
    Hydra rewrote it (to name what differs when its journal is refused).
    """
    layout = _layout(cfg, typed)
    digest = config_hash(cfg)
    describe = str(getattr(cfg.mode, "value", cfg.mode)) == "describe"
    if cfg.get("resume"):
        _continue_journal(from_start_dir(str(cfg.resume)), run_dir, digest, cfg, copy=not describe,
                          previous_config=previous_config)
    elif not describe:
        _check_own_journal(run_dir, digest, cfg, previous_config)
    return RunContext(cfg=cfg, typed=typed, run_dir=run_dir, gpu=typed["hardware"].gpu_spec(), model=layout.model,
                      parallel=layout.parallel, workload=layout.workload, partitioning=layout.partitioning,
                      config_hash=digest)



def _check_own_journal(run_dir: Path, digest: str, cfg: Any, previous_config: bytes | None) -> None:
    """A run directory that already holds a journal (``hydra.run.dir`` reused) continues it only under
    the same config; another config is refused here, before the run records anything."""
    from kareus.errors import KareusError
    from kareus.profiler.journal import JournalError, JournalMismatchError, check_journal, journal_path_for

    own = journal_path_for(run_dir)
    if not own.exists():
        return
    try:
        check_journal(own, digest)
    except JournalMismatchError as err:
        saved = previous_config if previous_config is not None else _saved_config(run_dir)  # not rewritten
        raise KareusError(f"journal: {err}{_differences(saved, cfg)}") from None
    except JournalError as err:
        raise KareusError(f"journal: {err}") from None


def _saved_config(run_dir: Path) -> Path:
    """The config a run saved beside its results (Hydra's default output subdir)."""
    return run_dir / ".hydra" / "config.yaml"


def _differences(saved: Path | bytes | None, cfg: Any, most: int = 6) -> str:
    """``; it differs in k (old -> new), ...``: what changed against a run's saved config (its file, or
    its bytes); "" when that config is gone or unreadable, or nothing measured differs (another
    Kareus revision)."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from kareus.config.hashing import measured_differences

    if saved is None:
        return ""
    try:
        old = OmegaConf.load(saved) if isinstance(saved, Path) else OmegaConf.create(saved.decode())
        diff = measured_differences(old, cfg)
    except (OSError, OmegaConfBaseException, ValueError, AttributeError):
        return ""
    table = OmegaConf.select(cfg, "hardware.table", default=None) if isinstance(cfg, DictConfig) else None
    if not diff and table:  # the same keys, so the table's contents (part of the hash) changed
        return f"; its config is the same, but the replay table {table} changed since it was measured"
    if not diff:
        return ""
    more = f", and {len(diff) - most} more" if len(diff) > most else ""
    return f"; it differs in {', '.join(diff[:most])}{more}"


def _continue_journal(old_run_dir: Path, run_dir: Path, digest: str, cfg: Any, copy: bool = True,
                      previous_config: bytes | None = None) -> None:
    """Check the old run's journal read-only, then copy it into ``run_dir`` to be continued there.

    Every refusal is one ``resume: ...`` line, raised before the run records anything. The copy makes
    each run directory self-contained (a chain of resumes measures nothing twice) and leaves the old
    run exactly as it was. Resuming into the old run's own directory continues its journal in place.
    Without ``copy`` (describe, which measures nothing) the old journal is only checked.
    ``previous_config``: as in ``build_context``, the saved config when the old run is ``run_dir``.
    """
    from kareus.errors import KareusError
    from kareus.profiler.journal import JournalError, JournalMismatchError, check_journal, copy_journal, journal_path_for

    if not old_run_dir.is_dir():
        raise KareusError(f"resume: {old_run_dir} is not a run directory")
    source, own = journal_path_for(old_run_dir), journal_path_for(run_dir)
    try:
        check_journal(source, digest)
    except JournalMismatchError as err:
        in_place = previous_config is not None and old_run_dir.resolve() == Path(run_dir).resolve()
        saved = previous_config if in_place else _saved_config(old_run_dir)  # Hydra rewrote the in-place one
        raise KareusError(f"resume: {err}{_differences(saved, cfg)}") from None
    except JournalError as err:
        raise KareusError(f"resume: {err}") from None
    if own.exists():
        if own.resolve() == source.resolve():
            return
        raise KareusError(f"resume: {run_dir} already has a journal; resume into a new run directory")
    if copy:
        copy_journal(source, own)
