"""The ``tracking`` config section: where and how a run is recorded in MLflow."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kareus.config.store import register_schema


@dataclass
class TrackingConfig:
    """MLflow tracking settings (``conf/tracking/default.yaml``).

    ``uri`` is any MLflow tracking URI: the default local SQLite store, or ``http://host:port`` of a
    tracking server on a cluster. Relative SQLite paths and ``artifact_location`` are taken from the
    directory the command was started in. ``artifact_location`` only applies to experiments created
    on a local store; a tracking server chooses its own artifact root.
    """

    enabled: bool = True
    uri: str = "sqlite:///runs/mlflow.db"
    artifact_location: Optional[str] = "runs/mlartifacts"
    experiment: str = "kareus"
    run_name: Optional[str] = None
    candidates: bool = True  # log every profiled candidate as it is measured
    flush_interval_s: float = 1.0  # candidate metrics are written at most this often (SQLite commits cost)
    plots: bool = True  # PNG plots of frontiers and hypervolume
    telemetry: bool = False  # MLflow's own usage telemetry; off unless asked for

    def problems(self, ctx: Any = None) -> list[str]:
        """Settings MLflow would refuse mid-run, or silently replace: an empty ``uri`` makes it pick
        ./mlflow.db (or $MLFLOW_TRACKING_URI); a folder or ``file:`` URI is its retired file store."""
        if not self.enabled:
            return []
        from urllib.parse import urlparse

        uri = str(self.uri or "").strip()
        out = []
        if not uri:
            out.append("tracking.uri: empty; give a store (default sqlite:///runs/mlflow.db) or a server "
                       "http://HOST:PORT, or set tracking.enabled=false")
        elif uri not in BARE_STORES and (urlparse(uri).scheme in ("", "file") or len(urlparse(uri).scheme) == 1):
            # a folder, a file: URI or a Windows path (c:\\...); "databricks" is MLflow's name for a workspace
            out.append("tracking.uri: MLflow's file store is retired; use a database such as "
                       f"sqlite:///runs/mlflow.db or a server http://HOST:PORT, got {uri!r}")
        elif uri not in BARE_STORES and urlparse(uri).scheme.split("+")[0] not in tracking_schemes():
            # MLflow would raise at the first write, after the run directory exists
            out.append(f"tracking.uri: unsupported scheme {urlparse(uri).scheme!r} in {uri!r}; allowed: "
                       f"{', '.join(tracking_schemes())} (a database may name its driver: postgresql+psycopg2)")
        elif uri.startswith("sqlite:") and not uri.startswith("sqlite:///") and uri.split("?", 1)[0] != "sqlite://":
            # SQLAlchemy's form: MLflow failed mid-run with "Could not parse" or "Invalid SQLite URL"
            out.append(f"tracking.uri: a SQLite store is sqlite:///RELATIVE/PATH.db or sqlite:////ABSOLUTE/PATH.db, "
                       f"got {uri!r}")
        elif uri.startswith("sqlite:") and uri.split("?", 1)[0] in ("sqlite://", "sqlite:///", "sqlite:///:memory:"):
            out.append(f"tracking.uri: {uri!r} is an in-memory database, gone when the run ends; give a file such as "
                       f"sqlite:///runs/mlflow.db, or set tracking.enabled=false")
        if not str(self.experiment or "").strip():
            out.append(f"tracking.experiment: must name an MLflow experiment (default kareus), got {self.experiment!r}")
        return out


# MLflow's own tracking stores; plugins add theirs through the "mlflow.tracking_store" entry points
TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "databricks-uc", "uc")
BARE_STORES = ("databricks", "databricks-uc", "uc")  # names MLflow takes without "://"


def tracking_schemes() -> tuple[str, ...]:
    """MLflow's store schemes and those of installed tracking-store plugins (no mlflow import)."""
    from importlib.metadata import entry_points

    plugins = tuple(sorted({ep.name for ep in entry_points(group="mlflow.tracking_store")} - set(TRACKING_SCHEMES)))
    return TRACKING_SCHEMES + plugins

register_schema("tracking", "default", TrackingConfig)


def as_tracking_config(value) -> TrackingConfig:
    """A TrackingConfig from itself, a (structured) DictConfig, a mapping, or None (the defaults)."""
    if value is None:
        return TrackingConfig()
    if isinstance(value, TrackingConfig):
        return value
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return TrackingConfig(**dict(value))
