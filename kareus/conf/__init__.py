"""Hydra configs, shipped with the package as kareus.conf."""
