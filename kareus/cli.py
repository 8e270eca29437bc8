"""``python -m kareus``: compose the config with Hydra, validate it, and run the chosen mode."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn

from kareus.components import register_all

register_all()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from kareus.config.overrides import CONFIG_MODULE, CONFIG_NAME, override_problems  # noqa: E402


def _run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _fail(lines: list[str], run_dir: Path | None) -> NoReturn:
    """Print one line per problem, remove the job folder if it holds only Hydra's files, exit 2."""
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    if run_dir is not None:
        _remove_job_dir(run_dir)
    sys.exit(2)


def _remove_job_dir(run_dir: Path) -> None:
    """Delete a refused job's folder (only Hydra's own files in it) and its parents left empty."""
    from hydra.core.hydra_config import HydraConfig

    if not run_dir.exists():
        return
    hydra_files = {".hydra", f"{HydraConfig.get().job.name}.log"}
    if not {p.name for p in run_dir.iterdir()} <= hydra_files:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
        rel = run_dir.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return  # outside the working directory: leave its parents alone
    for parent in (Path.cwd() / rel).parents:
        if parent.resolve() == Path.cwd().resolve() or any(parent.iterdir()):
            break
        parent.rmdir()


def _group_options(group: str) -> list[str]:
    from hydra.core.global_hydra import GlobalHydra

    return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def app(cfg: DictConfig) -> Any:
    """The Hydra task: validate everything first, then run the mode."""
    from kareus.config.validate import ConfigError, validate

    run_dir = _run_dir()
    try:
        typed = validate(cfg)
    except ConfigError as err:
        lines = list(err.problems)
        if any(line.startswith("model: no model selected") for line in lines):
            models = ", ".join(_group_options("model"))
            lines = [f"model: no model selected; add +model=NAME with NAME one of: {models}"
                     if line.startswith("model: no model selected") else line for line in lines]
        _fail(lines, run_dir)
    from kareus.pipeline import run_mode
    from kareus.errors import KareusError

    try:
        return run_mode(cfg, typed, run_dir)
    except KareusError as err:
        _fail([str(err)], run_dir)


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
def _hydra_main(cfg: DictConfig) -> Any:
    return app(cfg)


def main() -> None:
    """Console entry point (``kareus`` and ``python -m kareus``)."""
    problems = override_problems(sys.argv[1:])
    if problems:
        _fail(problems, None)
    _hydra_main()


if __name__ == "__main__":
    main()
