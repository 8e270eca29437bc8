"""The run: workload -> partitions -> searches -> composition -> plans, each stage a module of its own."""
from kareus.pipeline.run import run_mode

__all__ = ["run_mode"]
