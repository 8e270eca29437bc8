"""Check the command-line overrides by composing them once before Hydra runs the job.

Hydra reports a bad override (an unknown option, a value its schema refuses, a typo in a key) as a
multi-line message and exit 1. Composing first turns each into one line that names the key and what it
allows, so a refused run looks like every other refused run: ``error: ...`` and exit 2, nothing written.
A sweep (``-m`` with Hydra's basic sweeper) is expanded into its jobs and every job is composed and
checked before the first one starts, so a sweep never stops half way on a config error. Calls this
cannot mirror exactly (other sweepers, Hydra's own flags other than ``--config-dir``) are left to Hydra.
"""
from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Sequence

from kareus.errors import a_noun, not_text

CONFIG_MODULE = "kareus.conf"
CONFIG_NAME = "config"
_CONFIG_DIR_FLAGS = ("--config-dir", "-cd")
_MULTIRUN_FLAGS = ("--multirun", "-m")
_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
_HINTS = ("To ", "Did you mean")  # Hydra's second lines that tell the user what to type instead

JobCheck = Callable[[Any], list[str]]  # a composed job config -> its problems, one line each


@dataclass
class _Call:
    overrides: list[str] = field(default_factory=list)
    config_dirs: list[str] = field(default_factory=list)
    multirun: bool = False


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else text


def _split_args(argv: Sequence[str]) -> _Call | None:
    """Overrides, ``--config-dir`` folders and ``-m``; None when another of Hydra's flags is present."""
    call = _Call()
    it = iter(argv)
    for arg in it:
        if arg in _CONFIG_DIR_FLAGS or any(arg.startswith(f + "=") for f in _CONFIG_DIR_FLAGS):
            value = arg.split("=", 1)[1] if "=" in arg else next(it, None)
            if value is None:
                return None
            call.config_dirs.append(value)
        elif arg in _MULTIRUN_FLAGS:
            call.multirun = True
        elif arg.startswith("-"):
            return None
        else:
            call.overrides.append(arg)
    return call


def flags_first(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``-m`` and ``--config-dir`` ahead of the overrides, as Hydra's parser needs them
    (``key=v -m key2=a,b`` is otherwise its usage text); unchanged when another of Hydra's flags is present."""
    call = _split_args(argv)
    if call is None:
        return list(argv)
    dirs = [arg for d in call.config_dirs for arg in ("--config-dir", d)]
    return [*(["--multirun"] if call.multirun else []), *dirs, *call.overrides]


def _with_hint(text: str) -> str:
    """The first line of Hydra's message, with the hint line that says what to type instead."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " ".join([lines[0], *(ln for ln in lines[1:] if ln.startswith(_HINTS))]) if lines else text


def _message(err: Exception) -> str:
    """One line for a composition error: the key, what was wrong, and the allowed values if known."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, ValidationError

    if isinstance(err, OverrideParseException):
        return f"override '{err.override}': {_first_line(err.message)} (see Hydra's override grammar)"
    if isinstance(err, MissingConfigException):
        missing = str(err.missing_cfg_file or "")
        group, _, option = missing.rpartition("/")
        if err.options:
            return f"{group}={option}: no such option; allowed: {', '.join(err.options)}"
        return _first_line(str(err))
    cause = err.__cause__ or err.__context__  # Hydra chains a user YAML's OmegaConf error implicitly
    where = re.match(r"In '([^']+)': ", str(err))
    source = f" (in {where.group(1)})" if where else ""
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        known = sorted(str(k) for k in cause.parent_node.keys()) if cause.parent_node is not None else []
        hint = f"; known: {', '.join(known)}" if known else ""
        return f"{cause.full_key}: unknown key{hint}{source}"
    if isinstance(cause, ConfigTypeError) and _first_line(cause.msg).startswith("Cannot merge DictConfig with"):
        # the section's schema (a dataclass), or dict for a free mapping (search.shares)
        return _section_expected(cause.full_key, cause.object_type, "a list" if "ListConfig" in cause.msg else "a value",
                                 source)
    if isinstance(cause, ValidationError):
        text = _first_line(cause.msg)
        converted = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", text)
        if converted:
            kind = converted.group(2).lower()
            text = f"'{converted.group(1)}' is not {a_noun(kind)}"
        elif "is not a valid bool" in text:
            text = f"{text.split(' is not a valid bool')[0][len('Value '):]} is not a bool; allowed: true, false"
        elif text.startswith("Invalid value") and "expected one of [" in text:
            value, allowed = text.split(", expected one of [", 1)
            text = f"{value.replace('Invalid value', 'invalid value')}; allowed: {allowed.rstrip(']')}"
        elif "is not a ListConfig" in text:
            text = _list_expected(cause, in_file=bool(where))
        scalar = re.match(r"Invalid type assigned: (\w+) is not a subclass of|Cannot assign (\w+) to Dict\[", text)
        if scalar:  # a value where a section belongs: the schema is the parent's field type
            hints = typing.get_type_hints(cause.object_type) if is_dataclass(cause.object_type) else {}
            section = hints.get(str(cause.full_key).rsplit(".", 1)[-1])
            kind = scalar.group(1) or scalar.group(2)
            return _section_expected(cause.full_key, section, a_noun(kind), source)
        return f"{cause.full_key}: {text}{source}"
    return _with_hint(str(err))


def _section_expected(key: str, section: Any, got: str, source: str = "") -> str:
    """The line for a list or a value given where a section belongs, naming the section's fields."""
    names = f" ({', '.join(f.name for f in fields(section))})" if is_dataclass(section) else ""
    return f"{key}: expects a section{names}, got {got}; set its fields as {key}.FIELD=VALUE{source}"


def _list_expected(cause: Any, in_file: bool = False) -> str:
    """A bare value given to a list key: say so, how to write it (as an override, or in a YAML file
    when ``in_file``), and what an item may be."""
    node = cause.parent_node._get_node(cause.key) if cause.parent_node is not None else None
    item = getattr(getattr(node, "_metadata", None), "element_type", None)
    enum = isinstance(item, type) and issubclass(item, Enum)
    allowed = f"; allowed items: {', '.join(str(m.value) for m in item)}" if enum else ""
    value = getattr(cause, "value", None)
    fix = f"{cause.key}: [{value}]" if in_file else f"{cause.full_key}=[{value}]"
    return f"expects a list, got '{value}'; write {fix}{allowed}"


def override_problems(argv: Sequence[str], check: JobCheck | None = None) -> list[str]:
    """Error lines for a call that would not compose; [] if it does or if Hydra decides.

    A sweep's jobs are each composed and given to ``check`` (e.g. the cross-field rules); their lines
    name the job by its swept values.
    """
    call = _split_args(argv)
    if call is None:
        return []
    missing = [d for d in call.config_dirs if not Path(d).is_dir()]
    if missing:
        return [f"--config-dir: {Path(d).resolve()} is not a folder" for d in missing]
    shadowed = _shadowed_options(call.config_dirs)
    if shadowed:
        return shadowed
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from kareus.components import register_all

    register_all()  # the schemas Hydra composes against
    try:
        parsed = OverridesParser.create().parse_overrides(call.overrides)
    except OverrideParseException as err:
        return [_message(err)]
    deleted = _deleted_settings(parsed)
    if deleted:
        return deleted
    if any(o.key_or_group == "hydra.mode" for o in parsed):
        return []  # hydra.mode=MULTIRUN is multirun without -m: Hydra's call
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps and not call.multirun:
        return [f"{sweeps[0]}: a sweep runs only with --multirun (-m); add it, or give one value"]
    overrides = call.overrides
    if call.config_dirs:
        if any(o.key_or_group == "hydra.searchpath" for o in parsed):
            return []
        overrides = [*overrides, *searchpath_overrides(argv)]
    from hydra import initialize_config_module

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        merged = _merged_group_lists(parsed)
        if merged:
            return merged
        return _sweep_problems(overrides, check) if call.multirun else _compose(overrides)[1]


def _deleted_settings(parsed: Sequence[Any]) -> list[str]:
    """``~mode``, ``~seed``, ``~parallel.tp``: a setting of the run's schema deleted. Top-level ones
    passed composition and crashed the run with a traceback (a run folder left behind); nested ones
    failed with Hydra's "Error merging override", which names no reason. ``~model`` stays Hydra's:
    the run then says it has no model."""
    import dataclasses

    from kareus.config.schema import KareusConfig

    fields = {f.name for f in dataclasses.fields(KareusConfig)} - {"model"}
    return [f"{o.key_or_group}: a setting of the run cannot be deleted (~{o.key_or_group}); set "
            f"{o.key_or_group}=VALUE instead, or leave it at its default"
            for o in parsed if o.is_delete() and o.key_or_group.split(".")[0] in fields]


MERGEABLE_GROUPS = ("experiment",)  # bundles of overrides: a list of them composes one ablation


def _merged_group_lists(parsed: Sequence[Any]) -> list[str]:
    """``parallel=[pp2_tp8,pp1_tp2]``: Hydra merges a list of a group's options into one config, so
    the later one silently wins key by key (or the merge fails with a message that names no key);
    for a group with one option per run that is a forgotten ``-m`` and a comma, not a choice."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    out = []
    for o in parsed:
        value = o.value()
        if o.is_sweep_override() or o.is_delete() or not isinstance(value, list):
            continue
        group = o.key_or_group
        options = sorted(loader.get_group_options(group)) if group not in MERGEABLE_GROUPS else []
        if options:
            out.append(f"{o.input_line}: {group} takes one option, and a list merges them into one config; choose "
                       f"one of: {', '.join(options)}; to run each, sweep: -m {o.get_key_element()}="
                       f"{','.join(map(str, value))}")
    return out


def _shadowed_options(config_dirs: Sequence[str]) -> list[str]:
    """A user's option named as a shipped one of its group, or a primary config beside them: Hydra
    picks the shipped file, so the user's edits would be ignored without a word."""
    import importlib

    shipped = Path(importlib.import_module(CONFIG_MODULE).__file__).parent
    options = sorted(p.relative_to(shipped) for p in shipped.glob("*/**/*.yaml"))  # in groups, not config.yaml
    out = []
    for folder in config_dirs:
        root = Path(folder).resolve()
        if (root / f"{CONFIG_NAME}.yaml").is_file():
            out.append(f"--config-dir: {root / CONFIG_NAME}.yaml would be ignored: the run's primary config is "
                       f"Kareus' own; put its settings in experiment/NAME.yaml (first line '# @package _global_') "
                       f"and choose it with +experiment=NAME")
        for option in options:
            if (root / option).is_file():
                group = option.parent.as_posix()
                out.append(f"--config-dir: {root / option} has the name of a shipped {group} option, which is "
                           f"the one chosen by {group}={option.stem}; rename the file")
    return out


def searchpath_overrides(argv: Sequence[str]) -> list[str]:
    """``hydra.searchpath=[...]`` for the call's ``--config-dir`` folders ([] without any): what
    composing, or listing a group's options, outside Hydra's own job needs to see the user's configs."""
    call = _split_args(argv)
    if call is None or not call.config_dirs:
        return []
    return [f"hydra.searchpath=[{','.join(f'file://{Path(d).resolve()}' for d in call.config_dirs)}]"]


def _compose(overrides: list[str], hydra: bool = True, multirun: bool = False) -> tuple[Any, list[str]]:
    """(config, []) or (None, [the composition error as one line]). ``hydra``: with Hydra's own
    section, whose output folder and log name are checked (the sweep's folder when ``multirun``)."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(CONFIG_NAME, overrides=overrides, return_hydra_config=hydra)
    except (HydraException, OmegaConfBaseException) as err:
        return None, [_repeated_group(err, overrides) or _group_given_a_value(overrides) or _message(err)]
    except UnicodeDecodeError as err:  # a ValueError too: a user's YAML file that is not text
        return None, [_file_not_text(err, overrides)]
    except ValueError as err:  # e.g. ``search=null``: Hydra refuses a group choice of null this way
        return None, [_null_choice(overrides) or _first_line(str(err))]
    except Exception as err:  # a user's YAML that does not parse; a value Hydra's merge trips over
        return None, [_unreadable(err) or _group_given_a_value(overrides)
                      or f"config: the overrides do not compose ({type(err).__name__}: {_first_line(str(err))})"]
    problems = _numbers_as_bools(cfg, overrides) + _numbers_as_bools_in_user_files(cfg, overrides)
    if hydra and not problems:
        problems = _output_problems(cfg, multirun)
    return (None, problems) if problems else (cfg, [])


def hydra_value(cfg: Any, key: str, as_job: bool = True) -> str:
    """``key`` of Hydra's section (``hydra.run.dir``), resolved as in the job (``as_job``):
    ``${hydra:job.name}`` needs Hydra's config set, which it is not yet while composing or in a
    run-start callback. Hydra's sweeper resolves the sweep's folder without it (``as_job=False``)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    held = HydraConfig.instance().cfg
    if as_job:
        HydraConfig.instance().set_config(cfg)
    try:
        return str(OmegaConf.select(cfg, key, throw_on_resolution_failure=True))
    finally:
        HydraConfig.instance().cfg = held


def _output_problems(cfg: Any, multirun: bool) -> list[str]:
    """The run's folder (``hydra.sweep.dir`` in a sweep) and log name as Hydra would resolve them: one
    that does not resolve (``${oc.env:UNSET}``), a folder that cannot be made, or a ``hydra.job.name``
    that is no file name fails inside Hydra with a traceback, before the job starts."""
    from omegaconf import OmegaConf

    from kareus.paths import folder_problem

    folder = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    values, out = {}, []
    for key in (folder, "hydra.job.name"):
        try:
            values[key] = hydra_value(cfg, key, as_job=key != "hydra.sweep.dir")
        except Exception as err:  # noqa: BLE001  (a resolver's own error, whatever its type)
            section, _, leaf = key.rpartition(".")
            raw = OmegaConf.to_container(OmegaConf.select(cfg, section), resolve=False)[leaf]
            why = _first_line(str(err.__cause__ or err))
            if "HydraConfig was not set" in why:
                why = "Hydra makes the sweep's folder before any job's ${hydra:...} is known"
            out.append(f"{key}: {raw} does not resolve ({why})")
    name = values.get("hydra.job.name")
    if name is not None and ("/" in name or "\\" in name or name in ("", ".", "..")):
        out.append(f"hydra.job.name: {name!r} names the run's log file (<name>.log) in its folder; "
                   f"give a plain file name, without '/' or '\\'")
    if values.get(folder):
        problem = folder_problem(values[folder])
        if problem:
            out.append(f"{folder}: {problem}")
    return out


def _repeated_group(err: Exception, overrides: list[str]) -> str | None:
    """``+model=a +model=b``: Hydra's "Multiple values for model" points at a defaults-list syntax
    that has no place on the command line."""
    found = re.match(r"Multiple values for ([\w/.-]+)\.", str(err))
    if found is None:
        return None
    group = found.group(1)
    given = [o for o in overrides if o.partition("=")[0].lstrip("+~") in (group, group.replace("/", "."))]
    if len(given) == 1 and given[0].startswith("+"):  # ``+search=tpe``: the group has its default option
        return f"{given[0]}: {group} already has an option (its default); choose another with {given[0][1:]}"
    return f"{group}: chosen more than once ({', '.join(given)}); give one option"


def _numbers_as_bools(cfg: Any, overrides: list[str]) -> list[str]:
    """``search.greedy=2``: OmegaConf turns any number into a bool (2 -> true, 0.5 -> true, '2' ->
    true), so a number typed where a switch belongs (a count meant for another key) would silently
    flip it. Checked in plain values and in dicts given to a section (``parallel={sequence_parallel:2}``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out: list[str] = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override() or o.is_delete():
            continue
        out += _number_bool_problems(cfg, o.key_or_group.lstrip("+"), o.value())
    return out


def _number_bool_problems(cfg: Any, key: str, value: Any) -> list[str]:
    from omegaconf import BooleanNode, OmegaConf

    if isinstance(value, dict):
        return [line for k, v in value.items() for line in _number_bool_problems(cfg, f"{key}.{k}", v)]
    if isinstance(value, bool) or not _reads_as_number(value):
        return []
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    child = node._get_node(leaf) if OmegaConf.is_dict(node) and leaf in node else None
    return [f"{key}: '{value}' is not a bool; allowed: true, false"] if isinstance(child, BooleanNode) else []


def _numbers_as_bools_in_user_files(cfg: Any, overrides: list[str]) -> list[str]:
    """The same silent flip from a user's option file (``--config-dir``): ``sequence_parallel: 2`` in
    ``my_conf/parallel/mine.yaml``. Shipped options are ours; a user's is chosen by an override (a
    shipped default is never a user's file: its name would shadow a shipped one, which is refused)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    dirs = [Path(str(p).removeprefix("file://")) for o in parsed if o.key_or_group == "hydra.searchpath"
            for p in (o.value() if isinstance(o.value(), list) else [o.value()])]
    out: list[str] = []
    for o in parsed:
        if o.is_sweep_override() or o.is_delete() or o.key_or_group == "hydra.searchpath":
            continue
        value = o.value()
        for option in (value if isinstance(value, list) else [value]):
            if not isinstance(option, str):
                continue
            found = [p for d in dirs if (p := d / o.key_or_group / f"{option}.yaml").is_file()]
            if found:  # the first folder on the search path that has it is the one Hydra reads
                out += [f"{line} (in {o.key_or_group}/{option})"
                        for line in _file_number_bools(cfg, found[0], o.key_or_group, option, o.package)]
    return out


def _file_number_bools(cfg: Any, path: Path, group: str, option: str, package: str | None) -> list[str]:
    """Numbers at switches in one option file, keyed where the file lands in the config: the
    override's ``@package``, else the file's ``# @package`` line, else its group."""
    import yaml

    text = path.read_text(encoding="utf-8")
    package = package or _package_line(text) or "_group_"
    package = package.replace("_group_", group.replace("/", ".")).replace("_name_", option)
    prefix = "" if package == "_global_" else package.removeprefix("_global_.")
    body = yaml.safe_load(text)
    if not isinstance(body, dict):
        return []
    out: list[str] = []
    for key, value in body.items():
        if key != "defaults":
            out += _number_bool_problems(cfg, f"{prefix}.{key}" if prefix else str(key), value)
    return out


def _package_line(text: str) -> str | None:
    """The ``# @package`` directive of a config file, read where Hydra reads it: the leading comments."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return None
        directive = re.match(r"#\s*@package\s+(\S+)", line)
        if directive:
            return directive.group(1)
    return None


def _reads_as_number(value: Any) -> bool:
    if isinstance(value, (int, float)):
        return True
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def _unreadable(err: Exception) -> str | None:
    """``<file>:<line>: not valid YAML (...)`` for a config file (a user's --config-dir) that does not parse."""
    import yaml

    if not isinstance(err, yaml.YAMLError):
        return None
    mark = getattr(err, "problem_mark", None)
    where = f"{mark.name}:{mark.line + 1}" if mark is not None else "a config file"
    return f"{where}: not valid YAML ({getattr(err, 'problem', None) or _first_line(str(err))})"


def _file_not_text(err: UnicodeDecodeError, overrides: list[str]) -> str:
    """``<file>: not UTF-8 text (...)``: the first YAML file of the user's config folders (the
    ``hydra.searchpath`` of ``overrides``; top level and group folders) that does not decode."""
    why = not_text(err)
    for o in overrides:
        if o.startswith("hydra.searchpath="):
            for entry in o.partition("=")[2].strip("[]").split(","):
                folder = Path(entry.strip().removeprefix("file://"))
                for path in sorted([*folder.glob("*.yaml"), *folder.glob("*/*.yaml")]):
                    try:
                        path.read_text(encoding="utf-8")
                    except UnicodeDecodeError:
                        return f"{path}: {why}"
                    except OSError:
                        continue
    return f"config: a config file is {why}"


def _group_given_a_value(overrides: list[str]) -> str | None:
    """``+model={name: x}``, ``profiler/cooldown={seconds: 1}``: a config group takes an option's name
    (Hydra's merge fails without a word, or names the top level's keys as the ones known)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    for o in OverridesParser.create().parse_overrides(overrides):
        if isinstance(o.value(), (dict, list)) and loader.get_group_options(o.key_or_group):
            add, group = "+" if o.is_add() else "", o.key_or_group
            return (f"{o.input_line}: {group} is a config group: choose an option by name "
                    f"({add}{group}=NAME) and set its fields as {group.replace('/', '.')}.FIELD=VALUE")
    return None


def _null_choice(overrides: list[str]) -> str | None:
    """``search=null``: name the group and its options (Hydra's ValueError names neither)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    for o in OverridesParser.create().parse_overrides(overrides):
        null = o.value() is None and not o.is_delete()
        options = sorted(loader.get_group_options(o.key_or_group)) if null else []
        if options:
            return f"{o.input_line}: a config group needs an option; allowed: {', '.join(options)}"
    return None


def _sweep_problems(overrides: list[str], check: JobCheck | None) -> list[str]:
    """Every job of a basic-sweeper sweep, composed and checked; lines name the job's swept values."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from kareus.tracking.records import redacted

    fixed = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()]
    base, problems = _compose(fixed, multirun=True)
    if problems:
        return problems
    sweeper = base.hydra.sweeper
    if sweeper.get("_target_") != _BASIC_SWEEPER:
        return []  # another sweeper chooses its jobs as it goes
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    try:
        parsed = parser.parse_overrides([*params, *overrides])
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except HydraException as err:
        return [_message(err)]
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    if not jobs:  # range(0,0), an empty glob: Hydra launches nothing and exits 0 (an empty sweep recorded)
        empty = [o.input_line for o in parsed if o.is_sweep_override() and not list(o.sweep_string_iterator())]
        return [f"{empty[0] if empty else 'the sweep'}: sweeps no value, so no job would run; give at least one"]
    lines = [f"{key}: one sweep records into one MLflow store and experiment; run one sweep per value"
             for key in sorted(swept) if key.lstrip("+~").startswith("tracking.")]
    stores: dict[tuple[str, str], str] = {}  # where each job records: the tracking group or a bundle may move it
    for num, job in enumerate(jobs):
        label = _job_label(job, swept)
        cfg, problems = _compose(job, hydra=False)
        if not problems and check is not None:
            problems = check(cfg)
        lines += [f"job {num} ({label}): {line}" for line in problems]
        if cfg is not None and not problems and cfg.tracking.enabled:
            stores.setdefault((str(cfg.tracking.uri), str(cfg.tracking.experiment)), label)
    if len(stores) > 1 and not lines:
        where = "; ".join(f"{label}: {redacted(uri)} experiment {exp}" for (uri, exp), label in stores.items())
        lines.append(f"tracking: one sweep records into one MLflow store and experiment, but its jobs record into "
                     f"{len(stores)} ({where}); run one sweep per store and experiment")
    return lines


def _job_label(job: Sequence[str], swept: set[str]) -> str:
    """A sweep job by the values it sweeps (all its overrides when none is swept)."""
    return " ".join(j for j in job if j.partition("=")[0] in swept) or " ".join(job)


def swept_override_keys(argv: Sequence[str]) -> set[str]:
    """The keys the command line gives several values (``search.passes``, ``+experiment``); a running
    sweep's overrides parsed, so they parse again."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    call = _split_args(argv)
    return set() if call is None else {o.get_key_element() for o in
                                       OverridesParser.create().parse_overrides(call.overrides)
                                       if o.is_sweep_override()}


def sweep_job_label(num: int, job: Sequence[str], argv: Sequence[str]) -> str:
    """``job N (swept values)`` for a running sweep job, named as ``override_problems`` names it."""
    return f"job {num} ({_job_label(job, swept_override_keys(argv))})"
