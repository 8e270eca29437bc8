"""``python -m kareus``: compose the config with Hydra, validate it, and run the chosen mode."""
from __future__ import annotations

import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from kareus.components import register_all

register_all()

import hydra  # noqa: E402
from hydra.core.object_type import ObjectType  # noqa: E402
from hydra.experimental.callback import Callback  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from kareus.config.overrides import (CONFIG_MODULE, CONFIG_NAME, flags_first, hydra_value,  # noqa: E402
                                     override_problems, searchpath_overrides, sweep_job_label)


@dataclass
class _Job:
    """What this process knows about its Hydra job, for cleaning up after a refusal or a stop."""

    made: Path | None = None  # the outermost folder this invocation created for its run directory
    run_dir: Path | None = None
    refused: list[str] = field(default_factory=list)  # sweep jobs refused at run time: "job N (overrides)"
    jobs: int = 0  # sweep jobs this process started
    # a run folder that already held a run: the files Hydra rewrites in it, as they were (None: absent)
    kept: dict[Path, bytes | None] = field(default_factory=dict)
    # a sweep folder that already held a sweep: its folders, and the Hydra files in them as they were
    sweep_dirs: set[Path] = field(default_factory=set)
    sweep_files: dict[Path, bytes] = field(default_factory=dict)
    job_made: Path | None = None  # in such a sweep folder: the outermost folder this job created


_JOB = _Job()


class RunDirCallback(Callback):
    """Notes, before Hydra creates it, which part of the run (or sweep) directory is new.

    A refused run removes only folders it made: never one that was there before, such as the
    working directory with ``hydra.run.dir=.``.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = Path(hydra_value(config, "hydra.run.dir"))
        _JOB.made = _first_missing(run_dir)
        if _JOB.made is None:  # Hydra rewrites its config files and appends to the log of what is there
            _JOB.kept = _hydra_files(run_dir, hydra_value(config, "hydra.job.name"),
                                     hydra_value(config, "hydra.output_subdir"))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(os.path.abspath(hydra_value(config, "hydra.sweep.dir", as_job=False)))
        _JOB.made = _first_missing(sweep)
        if _JOB.made is None:  # each job's refusal puts back, or removes, what Hydra wrote for it
            _JOB.sweep_dirs = {sweep, *(p for p in sweep.rglob("*") if p.is_dir())}
            names = _hydra_file_names(hydra_value(config, "hydra.job.name"),
                                      hydra_value(config, "hydra.output_subdir"))
            _JOB.sweep_files = {d / n: (d / n).read_bytes() for d in _JOB.sweep_dirs for n in names
                                if (d / n).is_file()}

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep whose jobs all left nothing (a describe sweep, or every job refused) leaves no
        folder either: Hydra's ``multirun.yaml`` and the id of the sweep's MLflow run (which keeps its
        own record) describe no result."""
        from kareus.tracking.store import PARENT_RUN_FILE

        sweep = Path(os.path.abspath(hydra_value(config, "hydra.sweep.dir", as_job=False)))
        if sweep.is_dir() and {p.name for p in sweep.iterdir()} <= {"multirun.yaml", PARENT_RUN_FILE}:
            _remove_made(sweep)


def _hydra_file_names(job_name: str, subdir: str) -> list[str]:
    """The files Hydra writes into a run folder, relative to it."""
    names = [f"{subdir}/{n}.yaml" for n in ("config", "hydra", "overrides")] if subdir != "None" else []
    return [*names, f"{job_name}.log"]


def _hydra_files(run_dir: Path, job_name: str, subdir: str) -> dict[Path, bytes | None]:
    """The files Hydra writes into a run folder, as they are now (None: absent)."""
    paths = [run_dir / n for n in _hydra_file_names(job_name, subdir)]
    return {p: (p.read_bytes() if p.is_file() else None) for p in paths}


def _note_reused_sweep_job(run_dir: Path) -> None:
    """A job of a sweep into a folder that held one: what its refusal must put back or remove."""
    from hydra.core.hydra_config import HydraConfig

    if not _JOB.sweep_dirs:
        return
    run_dir = Path(os.path.abspath(run_dir))
    hc = HydraConfig.get()
    if run_dir in _JOB.sweep_dirs:
        _JOB.job_made = None
        _JOB.kept = {run_dir / n: _JOB.sweep_files.get(run_dir / n)
                     for n in _hydra_file_names(hc.job.name, str(hc.output_subdir))}
        return
    _JOB.kept = {}
    made = run_dir
    while made.parent not in _JOB.sweep_dirs and made.parent != made:
        made = made.parent
    _JOB.job_made = made if made.parent in _JOB.sweep_dirs else None  # None: a job folder outside the sweep's


def _kept_config() -> bytes | None:
    """The saved config of the run this folder held before Hydra rewrote it (None: a new folder)."""
    return next((data for path, data in _JOB.kept.items() if path.name == "config.yaml"), None)


def _restore_kept() -> None:
    """A refused run in a folder that already held a run: put back what Hydra rewrote there, so the
    folder's config still describes the results beside it."""
    for path, data in _JOB.kept.items():
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(data)
    configs = {p.parent for p in _JOB.kept if p.suffix == ".yaml"}
    for folder in configs:  # Hydra's config folder, if only this refusal made it
        if all(_JOB.kept[p] is None for p in _JOB.kept if p.parent == folder) and folder.is_dir() \
                and not any(folder.iterdir()):
            folder.rmdir()


def _first_missing(path: Path) -> Path | None:
    """The outermost folder on the way to ``path`` that does not exist yet; None if ``path`` exists."""
    path = Path(os.path.abspath(path))
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def _run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _fail(lines: list[str], run_dir: Path | None, restore: bool = True) -> NoReturn:
    """Print one line per problem, remove the job folder if this job made it for nothing, exit 2.
    ``restore``: put back what Hydra rewrote in a folder that held a run (not once this run's outputs
    replaced that run's)."""
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    if run_dir is not None:
        _remove_job_dir(run_dir)
        if restore:
            _restore_kept()
    sys.exit(2)


def _remove_job_dir(run_dir: Path) -> None:
    """Delete a refused job's folder if this job made it and it holds only Hydra's own files, then the
    folders above it that this job made and left empty; never the working directory or its parents."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(os.path.abspath(run_dir))
    cwd = Path(os.path.abspath(HydraConfig.get().runtime.cwd))
    if not run_dir.is_dir() or run_dir == cwd or run_dir in cwd.parents:
        return  # (whether this job made it, ``_remove_made`` checks)
    hydra_files = {".hydra", f"{HydraConfig.get().job.name}.log"}
    if not {p.name for p in run_dir.iterdir()} <= hydra_files:
        return
    _remove_made(run_dir)


def _remove_made(folder: Path) -> None:
    """Delete ``folder`` if this run (or sweep) made it, then the folders above it that it made and
    left empty."""
    made = _JOB.job_made or _JOB.made
    if made is None or (folder != made and made not in folder.parents):
        return
    shutil.rmtree(folder, ignore_errors=True)
    for parent in folder.parents:
        if parent != made and made not in parent.parents:
            break
        try:
            parent.rmdir()  # only when empty: another job may be writing beside this one
        except OSError:
            break


def _group_options(group: str, kind: ObjectType = ObjectType.CONFIG) -> list[str]:
    """The options of ``group`` (``kind``: CONFIG, or GROUP for its subgroups)."""
    from hydra.core.global_hydra import GlobalHydra

    # with the call's --config-dir folders: the pre-check's loader, unlike the job's, lacks them
    loader = GlobalHydra.instance().config_loader()
    extra = searchpath_overrides(sys.argv[1:])
    return sorted(loader.get_group_options(group, kind, config_name=CONFIG_NAME, overrides=extra))


_INTERNAL_GROUPS = ("hydra", "schema")  # Hydra's own groups and the typed schemas behind the options


def _choice_groups(parent: str = "") -> list[str]:
    """Every config group a user chooses an option of, nested ones included, internal ones left out."""
    out: list[str] = []
    for name in _group_options(parent, ObjectType.GROUP):
        group = f"{parent}/{name}" if parent else name
        if group.split("/")[0] in _INTERNAL_GROUPS:
            continue
        if _group_options(group):
            out.append(group)
        if _group_options(group, ObjectType.GROUP):
            out += _choice_groups(group)
    return out


def _list_groups_from_one_repository() -> None:
    """Make ``--help`` (and ``--hydra-help``) list config groups from one copy of the config repository.

    Hydra's loader deep-copies the whole repository, every registered schema included, for each
    ``get_group_options`` call, and its help lists every group (Hydra's own too, eagerly, whatever the
    template shows): about 240 copies, 8 s on a 2-core machine. Listing only reads the repository, so
    one copy per (config, overrides) serves them all. Only the help flags take this path: composing a
    config, which may change what it loads, keeps its own copy.
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    if not hasattr(ConfigLoaderImpl, "_parse_overrides_and_create_caching_repo"):
        return  # another Hydra: its own listing, only slower
    repos: dict[tuple, Any] = {}

    def get_group_options(self: Any, group_name: str, results_filter: ObjectType | None = ObjectType.CONFIG,
                          config_name: str | None = None, overrides: list[str] | None = None) -> list[str]:
        key = (id(self), config_name, tuple(overrides or ()))
        if key not in repos:
            repos[key] = self._parse_overrides_and_create_caching_repo(config_name, list(overrides or ()))[1]
        return repos[key].get_group_options(group_name, results_filter)

    ConfigLoaderImpl.get_group_options = get_group_options


def help_groups() -> str:
    """``--help``'s list of config groups (``group: option, ...``), without Hydra's and the schemas'."""
    return "\n".join(f"{g}: {', '.join(_group_options(g))}" for g in sorted(_choice_groups()))


OmegaConf.register_new_resolver("kareus_help_groups", help_groups, replace=True)


def _checked(cfg: DictConfig) -> tuple[dict[str, Any] | None, list[str]]:
    """(typed sections, []) for a config that can run, else (None, one line per problem)."""
    from kareus.config.validate import ConfigError, validate
    from kareus.tracking.store import artifact_location_problem, reachability_problem

    try:
        typed = validate(cfg)
    except ConfigError as err:
        models = ", ".join(_group_options("model"))
        return None, [f"model: no model selected; add +model=NAME with NAME one of: {models}"
                      if line.startswith("model: no model selected") else line for line in err.problems]
    from kareus.pipeline.context import partition_problems

    layout = partition_problems(cfg, typed)
    if layout:
        return None, layout
    tracking = typed["tracking"]
    if tracking.enabled and str(getattr(cfg.mode, "value", cfg.mode)) not in ("describe", "reset"):
        problem = reachability_problem(tracking.uri)
        if problem:
            return None, [f"tracking.uri: {problem}"]
        problem = artifact_location_problem(tracking.artifact_location, tracking.uri)
        if problem:
            return None, [f"tracking.artifact_location: {problem}"]
    return typed, []


def _problems(cfg: DictConfig) -> list[str]:
    return _checked(cfg)[1]


def app(cfg: DictConfig) -> Any:
    """The Hydra task: validate everything first, then run the mode."""
    run_dir = _run_dir()
    _JOB.run_dir = run_dir
    _JOB.jobs += 1
    _note_reused_sweep_job(run_dir)
    typed, problems = _checked(cfg)
    if typed is None:
        _fail(problems, run_dir)
    from kareus.errors import JobRefused, KareusError, OutputClosed, RefusedWithOutputs, machine_failure
    from kareus.pipeline import run_mode

    # describe measures nothing and reset only gives back GPU clocks: neither writes to its run folder
    describe = str(getattr(cfg.mode, "value", cfg.mode)) in ("describe", "reset")
    job = _sweep_job()
    try:
        if job is not None:  # a sweep's results on stdout name their job (Hydra's launch lines go to stderr)
            _print_result_line(f"== {job} ==")
        out = run_mode(cfg, typed, run_dir, _kept_config())
        # describe measured and wrote nothing, and a training rank but the first writes nothing either (rank
        # 0's folder holds the run): no empty run folder left behind, nor a folder's config rewritten
        # beside the results of the run it holds
        if describe or (isinstance(out, dict) and out.get("remove_run_dir")):
            _remove_job_dir(run_dir)
            _restore_kept()
        if job is None and isinstance(out, dict) and out.get("exit_code"):  # mode=check: 3 when something drifted
            sys.exit(int(out["exit_code"]))
        return out
    except OutputClosed:  # the reader left (``| head``): stop as a shell tool does, quietly
        _stdout_to_devnull()
        if describe:
            _remove_job_dir(run_dir)
            _restore_kept()
        else:  # what it measured is journaled: say how to go on
            from kareus.profiler.journal import journal_path_for

            if journal_path_for(run_dir).is_file():
                print(f"output closed; continue with resume={run_dir}", file=sys.stderr)
        sys.exit(128 + signal.SIGPIPE)
    except KareusError as err:
        if job is None:
            _fail([str(err)], run_dir, restore=not isinstance(err, RefusedWithOutputs))
        print(f"error: {job}: {err}", file=sys.stderr)
        _remove_job_dir(run_dir)
        if not isinstance(err, RefusedWithOutputs):
            _restore_kept()
        _JOB.refused.append(job)
        return JobRefused(job, str(err))  # the sweep goes on; main() reports and exits 2 at its end
    except Exception as err:  # noqa: BLE001  (a full disk is the machine's; anything else keeps its traceback)
        line = machine_failure(err)
        if line is None:
            raise
        print(f"error: {_stopped(line)}", file=sys.stderr)
        sys.exit(1)  # a sweep stops too: its next job would meet the same disk


def _print_result_line(line: str) -> None:
    """A line on stdout; a reader that left (``| head``) is OutputClosed, as for rich's console."""
    from kareus.errors import OutputClosed

    try:
        print(line, flush=True)
    except BrokenPipeError:
        raise OutputClosed from None


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so flushing it at exit does not raise a second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _sweep_job() -> str | None:
    """``job N (overrides)`` inside a ``-m`` sweep, None in a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return sweep_job_label(hc.job.num, list(hc.overrides.task), sys.argv[1:])


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
def _hydra_main(cfg: DictConfig) -> Any:
    return app(cfg)


def _stopped(why: str) -> str:
    """``interrupted; continue with resume=<run dir>`` when the run has a journal to continue."""
    from kareus.profiler.journal import journal_path_for

    run_dir = _JOB.run_dir
    journal = None if run_dir is None else journal_path_for(run_dir)
    if journal is None or not journal.is_file() or journal.stat().st_size == 0:  # nothing written to continue
        return why
    return f"{why}; continue with resume={run_dir}"


def _terminate(signum: int, frame: Any) -> NoReturn:
    """SIGTERM as an exit, so open MLflow runs are closed (KILLED) and exit hooks run."""
    print(_stopped("terminated"), file=sys.stderr)
    raise SystemExit(128 + signal.SIGTERM)


def main() -> None:
    """Console entry point (``kareus`` and ``python -m kareus``)."""
    if {"--help", "-h", "--hydra-help"} & set(sys.argv[1:]):
        _list_groups_from_one_repository()
    problems = override_problems(sys.argv[1:], _problems)
    if problems:
        _fail(problems, None)
    sys.argv[1:] = flags_first(sys.argv[1:])
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        _hydra_main()
    except KeyboardInterrupt:
        print(_stopped("interrupted"), file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if _JOB.refused:  # a sweep whose jobs all ran, some refused: one summary line, as a refused run
        print(f"error: {len(_JOB.refused)} of {_JOB.jobs} sweep jobs were refused: {'; '.join(_JOB.refused)}",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
