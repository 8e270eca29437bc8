"""The planner stays light: importing the CLI (which registers every component) loads no heavy module."""
from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "megatron", "mlflow", "xgboost", "optuna", "ray", "matplotlib", "lowtime", "botorch", "zeus")


def test_cli_import_loads_no_heavy_module():
    code = ("import sys, kareus.cli\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_registries_hold_the_documented_components():
    import kareus.components
    from kareus.registry import (COMPOSERS, COOLDOWNS, FREQUENCY_CONTROLLERS, HARDWARE, LAUNCHERS, PARTITIONERS,
                                 SEARCHERS)

    kareus.components.register_all()
    assert {"sim", "replay", "cuda"} <= set(HARDWARE.names())
    assert {"nanobatch", "sequential"} <= set(PARTITIONERS.names())
    assert {"mbo", "exhaustive", "random", "nsga2", "tpe", "qnehvi", "artifact"} <= set(SEARCHERS.names())
    assert {"kareus", "perseus"} <= set(COMPOSERS.names())
    assert {"fixed", "none", "temperature", "thermal"} <= set(COOLDOWNS.names())
    assert {"sim", "nvml", "zeus"} <= set(FREQUENCY_CONTROLLERS.names())
    assert {"local", "process", "ray"} <= set(LAUNCHERS.names())
