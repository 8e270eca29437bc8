"""Shared fixtures for the hardware tests: the A100 config from its YAML and a published partition."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def shipped_gpu_config():
    """The shipped cuda hardware config of this machine's GPU 0 (comm ``copy``, NVML energy); the test
    is skipped for a GPU model Kareus ships no config of."""
    import pytest
    import torch

    from kareus.runtime.backend import SHIPPED_CUDA_MODELS, gpu_model, shipped_cuda_config

    name = torch.cuda.get_device_name(0)
    if gpu_model(name).lower() not in SHIPPED_CUDA_MODELS:
        pytest.skip(f"no shipped hardware config for {name}")
    return shipped_cuda_config(name, device="cuda", comm="copy", energy="nvml")


def sim_config(name: str = "a100_sim", **overrides):
    """The SimConfig that conf/hardware/<name>.yaml describes (schema-typed, as Hydra would)."""
    import dataclasses

    return dataclasses.replace(_yaml_config(name), **overrides)


@lru_cache(maxsize=None)
def _yaml_config(name: str):
    import kareus.hardware  # noqa: F401  (registers the backends)
    from kareus.hardware.sim_config import SimConfig
    from kareus.registry import to_dataclass

    data = yaml.safe_load((ROOT / "conf/hardware" / f"{name}.yaml").read_text())
    data.pop("defaults", None)
    return to_dataclass(SimConfig, data)


@lru_cache(maxsize=None)
def llama_partitions():
    """Partition types of llama3.2-3b at TP=4 from the project's workload model and partitioner."""
    import kareus.partition  # noqa: F401  (registers the partitioners)
    from kareus.registry import PARTITIONERS
    from kareus.types import ModelSpec, ParallelSpec
    from kareus.workload import build_workload

    model = ModelSpec("llama3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256)
    par = ParallelSpec(tp=4, pp=1, micro_batch_size=4, num_microbatches=4, seq_len=4096)
    return PARTITIONERS.build("nanobatch", config={}).partition(build_workload(model, par))


@lru_cache(maxsize=None)
def tiny_partitions():
    """Partition types of the shipped tiny model at TP=2 (``+model=tiny parallel=pp1_tp2``): kernels
    so small that calls turn host-bound as the clock rises."""
    import kareus.partition  # noqa: F401  (registers the partitioners)
    from omegaconf import OmegaConf

    from kareus.config.schema import ModelConfig, ParallelConfig
    from kareus.registry import PARTITIONERS
    from kareus.workload import build_workload

    conf = ROOT / "kareus" / "conf"
    model, par = (OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(conf / path))).spec()
                  for schema, path in ((ModelConfig, "model/tiny.yaml"), (ParallelConfig, "parallel/pp1_tp2.yaml")))
    return PARTITIONERS.build("nanobatch", config={}).partition(build_workload(model, par))


def attention_partition():
    return llama_partitions().type("fwd_attn")
