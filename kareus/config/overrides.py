"""Check the command-line overrides by composing them once before Hydra runs the job.

Hydra reports a bad override (an unknown option, a value its schema refuses, a typo in a key) as a
multi-line message and exit 1. Composing first turns each into one line that names the key and what it
allows, so a refused run looks like every other refused run: ``error: ...`` and exit 2, nothing written.
Calls this cannot mirror exactly (multirun, sweeps, Hydra's own flags other than ``--config-dir``) are
left to Hydra.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

CONFIG_MODULE = "kareus.conf"
CONFIG_NAME = "config"
_CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else text


def _split_args(argv: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """(overrides, extra search-path overrides); None when a flag other than --config-dir is present."""
    overrides: list[str] = []
    extra: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in _CONFIG_DIR_FLAGS or any(arg.startswith(f + "=") for f in _CONFIG_DIR_FLAGS):
            value = arg.split("=", 1)[1] if "=" in arg else next(it, None)
            if value is None:
                return None
            extra.append(value)
        elif arg.startswith("-"):
            return None
        else:
            overrides.append(arg)
    return overrides, extra


def _message(err: Exception) -> str:
    """One line for a composition error: the key, what was wrong, and the allowed values if known."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(err, OverrideParseException):
        return f"override '{err.override}': {_first_line(err.message)} (see Hydra's override grammar)"
    if isinstance(err, MissingConfigException):
        missing = str(err.missing_cfg_file or "")
        group, _, option = missing.rpartition("/")
        if err.options:
            return f"{group}={option}: no such option; allowed: {', '.join(err.options)}"
        return _first_line(str(err))
    cause = err.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        known = sorted(str(k) for k in cause.parent_node.keys()) if cause.parent_node is not None else []
        hint = f"; known: {', '.join(known)}" if known else ""
        return f"{cause.full_key}: unknown key{hint}"
    if isinstance(cause, ValidationError):
        text = _first_line(cause.msg)
        converted = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", text)
        if converted:
            kind = converted.group(2).lower()
            text = f"'{converted.group(1)}' is not {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
        elif "is not a valid bool" in text:
            text = f"{text.split(' is not a valid bool')[0][len('Value '):]} is not a bool; allowed: true, false"
        elif text.startswith("Invalid value") and "expected one of [" in text:
            value, allowed = text.split(", expected one of [", 1)
            text = f"{value.replace('Invalid value', 'invalid value')}; allowed: {allowed.rstrip(']')}"
        return f"{cause.full_key}: {text}"
    return _first_line(str(err))


def override_problems(argv: Sequence[str]) -> list[str]:
    """Error lines for command-line overrides that would not compose; [] if they do or if Hydra decides."""
    split = _split_args(argv)
    if split is None:
        return []
    overrides, config_dirs = split
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from kareus.components import register_all

    register_all()  # the schemas Hydra composes against

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as err:
        return [_message(err)]
    if any(o.key_or_group == "hydra.mode" for o in parsed):
        return []  # hydra.mode=MULTIRUN is multirun without -m: Hydra's call
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps:
        return [f"{sweeps[0]}: a sweep runs only with --multirun (-m); add it, or give one value"]
    if config_dirs:
        if any(o.key_or_group == "hydra.searchpath" for o in parsed):
            return []
        paths = ",".join(f"file://{Path(d).resolve()}" for d in config_dirs)
        overrides = [*overrides, f"hydra.searchpath=[{paths}]"]
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            compose(CONFIG_NAME, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        return [_message(err)]
    return []
