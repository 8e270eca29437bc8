"""Kareus: energy-optimal overlap, comm SMs and GPU clocks for Megatron-style training."""

__version__ = "0.1.0"
