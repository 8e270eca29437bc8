"""One pass over a composed config that reports every cross-field problem at once.

Types, unknown keys and enum values are already checked by the schemas at composition; this checks
the rules that relate fields to each other and to the GPU, without building anything. Component
configs contribute their own rules through a ``problems(ctx) -> list[str]`` method.
"""
from __future__ import annotations

import re

from dataclasses import dataclass
from typing import Any

from kareus.config.bounds import MAX_SEED
from kareus.config.store import plain_schema
from kareus.hardware.base import GPUSpec
from kareus.registry import (COMPOSERS, HARDWARE, LAUNCHERS, PARTITIONERS, SEARCHERS, Registry,
                             UnknownComponentError, to_dataclass)

# Sections chosen by name from a registry, and sections with one fixed schema.
REGISTRY_SECTIONS: dict[str, Registry] = {
    "hardware": HARDWARE, "partitioner": PARTITIONERS, "search": SEARCHERS,
    "compose": COMPOSERS, "launcher": LAUNCHERS,
}
PLAIN_SECTIONS: tuple[str, ...] = ("profiler", "plan", "tracking")


class ConfigError(ValueError):
    """A config that cannot run. ``problems`` holds one line per problem, each naming its key."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ValidationContext:
    """What a component's own rules may look at: the GPU and the layout."""

    gpu: GPUSpec | None
    parallel: Any
    model: Any
    mode: str
    real_gpu: bool = False  # the hardware backend measures a physical GPU (one per process)
    recorded_space: bool = False  # the backend answers a recorded set of settings only (replay)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _options_named(group: str, name: str) -> list[str]:
    """The shipped option files of ``group`` whose ``name:`` is ``name`` (``hardware.name=cuda`` is
    chosen as ``hardware=a100_cuda``, ...): what to tell a user who set the name instead of the option."""
    import re
    from importlib.resources import files

    folder = files("kareus.conf") / group
    found = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name) if folder.is_dir() else ():
        if entry.name.endswith(".yaml") and re.search(rf"(?m)^name:\s*{re.escape(name)}\s*(#.*)?$", entry.read_text()):
            found.append(entry.name[: -len(".yaml")])
    return found


def _typed_section(key: str, section: Any, problems: list[str]) -> Any:
    """The section as its typed dataclass, or None with the problem recorded."""
    if key in REGISTRY_SECTIONS:
        registry = REGISTRY_SECTIONS[key]
        name = section.get("name") if section is not None else None
        try:
            entry = registry.get(str(name))
        except UnknownComponentError as exc:
            problems.append(f"{key}.name: {exc}")
            return None
        if entry.config_cls is None:
            return section
        try:
            return registry.build_config(str(name), section)
        except Exception as exc:
            line = _first_line(exc)
            if "not in '" in line or "is not a subclass" in line:  # another component's fields under this name
                options = _options_named(key, str(name))
                choose = (f"{key}={options[0]}" if len(options) == 1 else
                          f"one of {', '.join(f'{key}={o}' for o in options)}" if options else f"{key}={name}")
                line += (f"; {key}.name={name} keeps the chosen {key}'s other settings: choose it with "
                         f"{choose} instead")
            problems.append(f"{key}: {line}")
            return None
    try:
        return to_dataclass(plain_schema(key), section)
    except Exception as exc:
        problems.append(f"{key}: {_first_line(exc)}")
        return None


MODEL_SIZES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
               "vocab_size")  # a model's shape fields: counts, so at least 1


def validate_model_parallel(model: Any, p: Any, gpus_per_node: int) -> list[str]:
    """Rules between the model shape and the parallel layout (Megatron's own constraints)."""
    problems = [f"parallel.{n}: must be >= 1, got {getattr(p, n)}"
                for n in ("tp", "pp", "cp", "dp", "micro_batch_size", "num_microbatches", "seq_len", "nanobatches")
                if getattr(p, n) < 1]
    if problems:
        return problems
    if p.micro_batch_size % p.nanobatches:
        problems.append(f"parallel.micro_batch_size: {p.micro_batch_size} does not split into "
                        f"parallel.nanobatches={p.nanobatches} equal nanobatches")
    if p.cp > 1 and p.seq_len % (2 * p.cp):  # without cp nothing splits the sequence
        problems.append(f"parallel.cp: seq_len {p.seq_len} must be divisible by 2*cp={2 * p.cp} "
                        "(causal load balancing)")
    elif p.sequence_parallel and (p.seq_len // p.cp) % p.tp:  # megatron scatters each sequence, not the batch
        problems.append(f"parallel.sequence_parallel: a sequence's {p.seq_len // p.cp} tokens per GPU "
                        f"(seq_len/cp) do not split over tp={p.tp}")
    if p.tp * p.cp > gpus_per_node:
        problems.append(f"parallel.tp: tp*cp={p.tp * p.cp} GPUs do not fit one node of {gpus_per_node} GPUs")
    elif gpus_per_node % (p.tp * p.cp):  # Megatron places a group on consecutive ranks: one would cross nodes
        problems.append(f"parallel.tp: tp*cp={p.tp * p.cp} does not divide a node's {gpus_per_node} GPUs "
                        f"(hardware.gpus_per_node): a tensor/context-parallel group would span two nodes")
    import kareus.compose.schedule  # noqa: F401  (registers the schedules)
    from kareus.registry import SCHEDULES

    if p.schedule not in SCHEDULES:
        problems.append(f"parallel.schedule: must be a known pipeline schedule ({', '.join(SCHEDULES.names())}), "
                        f"got {p.schedule!r}")
    if model is None:
        return problems
    m = model
    shape = [f"model.{n}: must be >= 1, got {getattr(m, n)}" for n in MODEL_SIZES if getattr(m, n) < 1]
    if shape:  # the rules below divide by these
        return problems + shape
    if m.num_attention_heads % p.tp:
        problems.append(f"parallel.tp: {p.tp} does not divide model.num_attention_heads={m.num_attention_heads}")
    if m.num_kv_heads % p.tp:
        problems.append(f"parallel.tp: {p.tp} does not divide model.num_kv_heads={m.num_kv_heads}")
    if m.num_attention_heads % m.num_kv_heads:
        problems.append(f"model.num_kv_heads: {m.num_kv_heads} does not divide "
                        f"model.num_attention_heads={m.num_attention_heads}")
    if m.ffn_hidden_size % p.tp:
        problems.append(f"parallel.tp: {p.tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}")
    if p.layer_split:
        if len(p.layer_split) != p.pp:
            problems.append(f"parallel.layer_split: has {len(p.layer_split)} entries for pp={p.pp} stages")
        elif sum(p.layer_split) != m.num_layers or min(p.layer_split) < 1:
            problems.append(f"parallel.layer_split: {list(p.layer_split)} must be positive and sum to "
                            f"model.num_layers={m.num_layers}")
    elif m.num_layers % p.pp:
        problems.append(f"parallel.pp: {p.pp} does not divide model.num_layers={m.num_layers}; "
                        "set parallel.layer_split to split unevenly")
    return problems


def measures_real_gpu(hardware: Any) -> bool:
    """Whether the hardware config measures a physical GPU (plugin configs may lack ``real_clock``)."""
    return bool(getattr(hardware, "real_clock", lambda: False)())


def validate_counter_period(hardware: Any, profiler: Any) -> list[str]:
    """A simulated energy counter that updates more slowly than the profiler's longest window (its
    target, doubled on each retry of a window too short to read): every window would fail, and the
    run end with no frontier."""
    period = getattr(hardware, "counter_period_s", None)
    target, retries = profiler.target_window_s, profiler.retries
    if not all(isinstance(v, (int, float)) for v in (period, target, retries)) or target <= 0 or retries < 0:
        return []  # reported by the sections' own rules
    longest = target * 2 ** retries
    if period <= longest:
        return []
    return [f"hardware.counter_period_s: {period:g} s is longer than the profiler's longest window "
            f"(profiler.target_window_s={target:g} s, doubled on each of {retries} retries: {longest:g} s), "
            f"so no window would see the energy counter update"]


def validate_clock_control(hardware: Any, profiler: Any) -> list[str]:
    """The frequency controller must lock the clock the backend measures at: a controller that only
    records the clock (``sim``) leaves a real GPU boosting freely, so every reading would be filed
    under a clock it never ran at; one that locks physical GPUs has nothing to lock on a simulated or
    replayed backend."""
    from kareus.profiler.config import section
    from kareus.registry import FREQUENCY_CONTROLLERS

    real = measures_real_gpu(hardware)
    name = str(section(profiler.frequency).get("name", ""))
    if name not in FREQUENCY_CONTROLLERS:
        return []  # reported by the profiler's own rules
    def fits(factory: Any) -> bool:  # locks_gpu None: a controller that leaves the clock alone fits both
        locks = getattr(factory, "locks_gpu", False)
        return locks is None or bool(locks) == real

    if fits(FREQUENCY_CONTROLLERS.get(name).factory):
        return []
    allowed = ", ".join(e.name for e in FREQUENCY_CONTROLLERS if fits(e.factory))
    why = (f"does not lock a real GPU's clock (hardware.name={hardware.name}, device=cuda)" if real
           else f"locks a physical GPU, but hardware.name={hardware.name} measures none")
    return [f"profiler.frequency: {name!r} {why}; allowed here: {allowed} (profiler/frequency=NAME)"]


def validate_unlocked_clock(profiler: Any, search: Any, gpu: Any) -> list[str]:
    """``profiler/frequency=unlocked`` measures at the GPU's own clock, nominally the top one: the
    space must hold that clock alone, and no cooldown may probe other clocks."""
    from kareus.profiler.config import section
    from kareus.search.space import clocks

    if str(section(profiler.frequency).get("name", "")) != "unlocked":
        return []
    from kareus.search.space import SpaceConfig

    out = []
    space = getattr(search, "space", None) or SpaceConfig()  # a searcher without one searches the default
    if clocks(space, gpu) != [gpu.max_mhz]:
        out.append(f"search.space.freq_mhz: profiler.frequency=unlocked measures at the top clock "
                   f"({gpu.max_mhz} MHz) alone; add +experiment=no_clock_search")
    cooldown_cfg = section(profiler.cooldown)
    cooldown = str(cooldown_cfg.get("name", ""))
    if cooldown == "thermal" and int(cooldown_cfg.get("reference_mhz", 0) or 0) not in (0, gpu.max_mhz):
        out.append(f"profiler.cooldown.reference_mhz: profiler.frequency=unlocked anchors at the top clock "
                   f"({gpu.max_mhz} MHz) alone; set 0")
    if cooldown == "compensated":
        out.append("profiler.cooldown: 'compensated' probes other clocks, which profiler.frequency=unlocked "
                   "cannot set; allowed here: fixed, none, temperature, predictive, thermal")
    return out


def _unknown_keys(prefix: str, node: Any) -> list[str]:
    """Keys a schema does not know. ``+key=value`` bypasses Hydra's struct check, so look again."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return []
    out: list[str] = []
    cls = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    for key in node.keys():
        if known is not None and key not in known:
            out.append(f"{prefix}{key}: unknown key; known: {', '.join(sorted(known))}")
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            out += _unknown_keys(f"{prefix}{key}.", child)
    return out


def _nested_items(prefix: str, node: Any) -> list[str]:
    """Items that are lists or mappings inside lists typed as plain values (``search.passes=[[total]]``):
    OmegaConf checks a typed list's plain items only, and the rules below would trip over a container."""
    import enum

    from omegaconf import DictConfig, ListConfig

    from kareus.errors import a_noun

    out: list[str] = []
    if not isinstance(node, DictConfig):
        return out
    for key in node.keys():
        child = node._get_node(key)
        if child is None or child._is_missing() or child._is_none():
            continue
        if isinstance(child, DictConfig):
            out += _nested_items(f"{prefix}{key}.", child)
        elif isinstance(child, ListConfig):
            kind = child._metadata.element_type
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                wants = f"one of {', '.join(str(m.value) for m in kind)}"
            elif kind in (str, int, float, bool):
                wants = a_noun(kind.__name__)
            else:
                continue
            for i in range(len(child)):
                item = child._get_node(i)
                if isinstance(item, (DictConfig, ListConfig)):
                    got = "a list" if isinstance(item, ListConfig) else "a mapping"
                    out.append(f"{prefix}{key}[{i}]: expects {wants}, got {got}")
    return out


TRAIN_DEVICES = ("auto", "cpu", "cuda")
TRAIN_COMMS = ("nccl", "mscclpp")


def train_problems(train: Any, parallel: Any = None) -> list[str]:
    """``train.*`` values mode=train could not run with, one line each (checked in every mode, as every
    section is)."""
    import math

    from kareus.runtime.mscclpp_comm import mscclpp_problem, sequence_parallel_problem

    if train is None:
        return []
    out = []
    if train.iterations < 1:
        out.append(f"train.iterations: must be >= 1, got {train.iterations}")
    if train.warmup < 0:
        out.append(f"train.warmup: must be >= 0, got {train.warmup}")
    if train.compare and not 2 <= train.blocks <= train.iterations:
        out.append(f"train.blocks: a comparison needs 2..train.iterations ({train.iterations}) blocks of at "
                   f"least one iteration each, got {train.blocks}")
    if train.compare and train.plan == "megatron":
        out.append("train.compare: compares a plan with Megatron's layout; train.plan=megatron names no plan")
    if not (math.isfinite(train.lr) and train.lr > 0):
        out.append(f"train.lr: must be a positive number, got {train.lr}")
    if str(train.device) not in TRAIN_DEVICES:
        out.append(f"train.device: must be one of {', '.join(TRAIN_DEVICES)}, got {train.device!r}")
    if str(train.comm) not in TRAIN_COMMS:
        out.append(f"train.comm: must be one of {', '.join(TRAIN_COMMS)}, got {train.comm!r}")
    elif train.comm == "mscclpp":
        sp = parallel is not None and bool(parallel.sequence_parallel) and int(parallel.tp) > 1
        out += [p for p in (mscclpp_problem("train.comm"), sequence_parallel_problem("train.comm", sp)) if p]
    return out


def check_problems(check: Any, mode: str) -> list[str]:
    """``check.*`` values mode=check could not run with, one line each; the run directory only in mode=check."""
    import math
    from pathlib import Path

    if check is None:
        return []
    out = []
    if check.samples < 1:
        out.append(f"check.samples: must be >= 1, got {check.samples}")
    if check.repeats < 2:
        out.append(f"check.repeats: must be >= 2 (their spread is the noise the test uses), got {check.repeats}")
    if not (math.isfinite(check.alpha) and 0 < check.alpha < 1):
        out.append(f"check.alpha: must be in (0, 1), got {check.alpha}")
    if not (math.isfinite(check.min_shift) and check.min_shift >= 0):
        out.append(f"check.min_shift: must be >= 0, got {check.min_shift}")
    if mode == "check":
        from kareus.config.paths import from_start_dir
        from kareus.profiler.journal import journal_path_for

        if not check.run:
            out.append("check.run: missing; give the run directory to check (check.run=runs/<date>/<time>)")
        elif not from_start_dir(str(check.run)).is_dir():
            out.append(f"check.run: {check.run} is not a run directory")
        elif not journal_path_for(from_start_dir(str(check.run))).is_file():
            out.append(f"check.run: {check.run} has no {Path(journal_path_for('.')).name}: not the directory of a "
                       "run that measured anything")
    return out


def validate(cfg: Any) -> dict[str, Any]:
    """Check a composed config; return the typed sections, or raise ConfigError listing every problem."""
    from omegaconf import DictConfig

    raw, cfg = cfg, _resolved(cfg)
    nested = _nested_items("", cfg)
    if nested:  # every later rule assumes plain items
        raise ConfigError(nested)
    problems: list[str] = _unknown_keys("", cfg)
    problems += [f"{key}: missing value" for key in sorted(_missing_keys(cfg))]
    typed: dict[str, Any] = {}
    for key in (*REGISTRY_SECTIONS, *PLAIN_SECTIONS):
        sec = _typed_section(key, cfg.get(key), problems)
        if sec is not None:
            typed[key] = sec
    gpu = None
    if "hardware" in typed:
        try:
            gpu = typed["hardware"].gpu_spec()
        except Exception as exc:
            problems += [ln if ln.startswith("hardware") else f"hardware: {ln}" for ln in str(exc).splitlines() if ln]
    mode = str(getattr(cfg.mode, "value", cfg.mode))
    if cfg.get("resume") is not None and not str(cfg.resume).strip():  # resume=$LAST with LAST unset
        problems.append("resume: empty; give the run directory to continue (resume=runs/<date>/<time>), or leave "
                        "resume unset for a new run")
    if isinstance(cfg.get("seed"), int) and not 0 <= cfg.seed <= MAX_SEED:
        problems.append(f"seed: must be in 0..{MAX_SEED} (numpy's and Optuna's seeds are 32-bit), got {cfg.seed}")
    model = cfg.get("model")
    if model is not None and _missing_keys(model):
        model = None  # its missing keys are reported above; rules over it would only repeat them
    # a replayed table's own partitions are searched (and described) without a model
    model_free = ("hardware" in typed and getattr(typed["hardware"], "name", "") == "replay"
                  and mode in ("search", "describe")) or mode == "reset"  # reset: clocks only, no workload
    if cfg.get("model") is None and not model_free:
        problems.append("model: no model selected")
    layout = validate_model_parallel(model, cfg.parallel, gpu.gpus_per_node if gpu else 8)
    problems += layout
    if not layout and model is not None and gpu is not None:
        from kareus.workload.memory import memory_problem

        fit = memory_problem(model, cfg.parallel, gpu.name, gpu.memory_gb)
        problems += [fit] if fit else []
    if "hardware" in typed and "profiler" in typed:
        problems += validate_clock_control(typed["hardware"], typed["profiler"])
        problems += validate_counter_period(typed["hardware"], typed["profiler"])
        if gpu is not None:
            problems += validate_unlocked_clock(typed["profiler"], typed.get("search"), gpu)
    problems += train_problems(cfg.get("train"), cfg.get("parallel"))
    problems += check_problems(cfg.get("check"), mode)
    real = "hardware" in typed and measures_real_gpu(typed["hardware"])
    recorded = "hardware" in typed and bool(getattr(typed["hardware"], "recorded_space", lambda: False)())
    ctx = ValidationContext(gpu=gpu, parallel=cfg.parallel, model=model, mode=mode, real_gpu=real,
                            recorded_space=recorded)
    # a rule may name a key of another section (the partitioner's parallel.nanobatches): kept as it is
    sections = {k for k in cfg.keys() if isinstance(cfg.get(k), (DictConfig, dict))}
    for key, sec in typed.items():
        rules = getattr(sec, "problems", None)
        if rules is None:
            continue
        try:
            lines = rules(ctx)
        except Exception as exc:
            lines = [f"{key}: cannot be checked: {_first_line(exc)}"]
        problems += [ln if ln.split(":")[0].split(".")[0] in sections else f"{key}.{ln}" for ln in lines]
    if problems:
        raise ConfigError(_without_echoes(raw, problems))
    return typed


def _without_echoes(raw: Any, problems: list[str]) -> list[str]:
    """``problems`` less the lines about a key that only repeats another's value (``search.seed:
    ${seed}``) and says what that key's own line says: one bad value, one line."""
    from omegaconf import DictConfig

    def source(key: str) -> str | None:
        node = raw
        for part in key.split("."):
            if not isinstance(node, DictConfig) or part not in node:
                return None
            node = node._get_node(part)
        m = re.fullmatch(r"\$\{([\w.]+)\}", str(node._value())) if node is not None else None
        return m.group(1) if m else None

    out = []
    for line in problems:
        key, _, said = line.partition(": ")
        src = source(key)
        if src is None or f"{src}: {said}" not in problems:
            out.append(line)
    return out


def _missing_keys(node: Any) -> set[str]:
    from omegaconf import DictConfig, OmegaConf

    return set(OmegaConf.missing_keys(node)) if isinstance(node, DictConfig) else set()


def _resolved(cfg: Any) -> Any:
    """A resolved copy: interpolations (``${seed}``, ``${hardware.max_mhz}``) need the whole tree,
    and sections are typed one by one."""
    import copy

    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(cfg, DictConfig):
        return cfg
    cfg = copy.deepcopy(cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError([f"{err.full_key or _unresolvable_key(cfg) or 'config'}: {_first_line(err)}"]) from None
    return cfg


def _unresolvable_key(node: Any, prefix: str = "") -> str | None:
    """The first key whose interpolation does not resolve (OmegaConf's resolve() names none)."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.errors import OmegaConfBaseException

    keys = range(len(node)) if isinstance(node, ListConfig) else node.keys()
    for k in keys:
        path = f"{prefix}[{k}]" if isinstance(node, ListConfig) else f"{prefix}.{k}" if prefix else str(k)
        try:
            child = node[k]
        except OmegaConfBaseException:
            return path
        if isinstance(child, (DictConfig, ListConfig)):
            found = _unresolvable_key(child, path)
            if found:
                return found
    return None
