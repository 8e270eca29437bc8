"""Connecting to an MLflow store: telemetry off, paths made absolute, one-time creation under a lock.

SQLite is not safe to initialise from several processes at once, and concurrent writers can meet
"database is locked"; everything that touches the store goes through :func:`connect` (creation
serialised by a file lock) and :func:`retry` (bounded back-off on lock errors).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlparse

from kareus.interrupts import signal_pending, signals_deferred

log = logging.getLogger(__name__)

T = TypeVar("T")

# A multirun's parent (sweep) run id, inherited by the jobs of the sweep.
ENV_PARENT_RUN = "KAREUS_MLFLOW_PARENT_RUN_ID"
PARENT_RUN_FILE = "mlflow_parent_run_id"  # written into the sweep directory as well

_REMOTE_SCHEMES = {"http", "https", "databricks", "databricks-uc"}
_LOCK_ERRORS = ("database is locked", "database table is locked", "sqlite_busy", "database schema has changed")

_clients: dict[str, Any] = {}
_experiments: dict[tuple[str, str], str] = {}


def _after_fork_in_child() -> None:
    """A forked worker must not reuse the parent's pooled SQLite connections (MLflow caches engines)."""
    _clients.clear()
    module = sys.modules.get("mlflow.store.tracking.sqlalchemy_store")
    for engine in list(getattr(getattr(module, "SqlAlchemyStore", None), "_engine_map", {}).values()):
        try:
            engine.dispose(close=False)  # fresh pool here; the parent's connections stay the parent's
        except Exception:  # an engine of another kind; nothing to hand over
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def disable_telemetry(telemetry: bool = False) -> None:
    """MLflow 3 sends usage telemetry unless told not to; must run before mlflow is imported."""
    if not telemetry:
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"


def import_mlflow(telemetry: bool = False):
    """Import mlflow lazily (it takes seconds), with telemetry settled first."""
    disable_telemetry(telemetry)
    import mlflow

    for name in ("mlflow.store.db.utils", "alembic.runtime.migration", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)  # table creation chatter
    return mlflow


def is_remote(uri: str) -> bool:
    return urlparse(uri).scheme in _REMOTE_SCHEMES


@functools.lru_cache(maxsize=None)
def reachability_problem(uri: str, timeout_s: float = 5.0) -> str | None:
    """Why an http(s) tracking server cannot be reached, or a local SQLite store's folder cannot be
    made (None if it can, or for other stores).

    One short request before the run starts: MLflow's client would otherwise retry for minutes and
    fail mid-run with a long traceback. Any HTTP answer, even an error status, counts as reachable.
    Cached: the jobs of a sweep share one answer.
    """
    import urllib.error
    import urllib.request

    db = sqlite_path(uri)
    if db is not None:
        return _sqlite_problem(db if db.is_absolute() else Path(base_dir()) / db)
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme in _DATABASES:
        return _database_problem(uri, timeout_s)
    if scheme not in ("http", "https"):
        return None
    missing = []  # the routes that answered "not found"
    # MLflow's liveness route, then its REST API (a proxy in front of a server may forward that alone)
    for route in ("/health", "/api/2.0/mlflow/experiments/search?max_results=1"):
        try:
            request = _request(uri, route)  # a port out of range or not a number raises here
            with urllib.request.urlopen(request, timeout=timeout_s):
                return None
        except urllib.error.HTTPError as err:
            if err.code != 404:  # an MLflow server behind a login (401, 403) or busy answers all the same
                return None
            missing.append(f"GET {request.selector}: {err.code} {err.reason}")
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            return f"cannot reach {_shown(uri)} ({reason}); start the tracking server, or set tracking.enabled=false"
    return (f"{_shown(uri)} answers, but not as an MLflow tracking server ({'; '.join(missing)}); check the host, "
            f"port and path, or set tracking.enabled=false")


def _request(uri: str, route: str):
    """GET ``<uri><route>``; credentials in the URI (which MLflow's client sends as basic auth) go in
    the header, not the host name."""
    import base64
    import urllib.request

    parts = urlparse(uri)
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"  # an IPv6 address
    if parts.port:
        netloc += f":{parts.port}"
    request = urllib.request.Request(parts._replace(netloc=netloc).geturl().rstrip("/") + route)
    if parts.username is not None:
        token = base64.b64encode(f"{parts.username}:{parts.password or ''}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    return request


def _sqlite_problem(db: Path) -> str | None:
    """Why a SQLite store cannot be used: its folder cannot be made, or the path holds a folder or a
    file that is no SQLite database (MLflow retried for minutes, or failed mid-run with a traceback)."""
    from kareus.paths import folder_problem

    fix = "choose another tracking.uri, or set tracking.enabled=false"
    if db.is_dir():
        return f"{db} is a folder, not a database file; {fix}"
    if db.is_file():
        try:
            with db.open("rb") as fh:
                head = fh.read(16)
        except OSError as err:
            return f"cannot read {db} ({err.strerror}); {fix}"
        if head and head != b"SQLite format 3\x00":
            return f"{db} is not an SQLite database; {fix}"
        return None
    problem = folder_problem(db.parent)
    return None if problem is None else f"{problem}; {fix}"


_DATABASES = ("postgresql", "mysql", "mssql")  # server databases MLflow reaches through SQLAlchemy


def _database_problem(uri: str, timeout_s: float) -> str | None:
    """Why a database store cannot be opened (its driver missing, its server down), or None: MLflow
    would raise that mid-run, after the run directory exists, as a long SQLAlchemy traceback."""
    try:
        import sqlalchemy

        engine = sqlalchemy.create_engine(uri, pool_pre_ping=False)
        try:
            with engine.connect():
                return None
        finally:
            engine.dispose()
    except ImportError as err:  # the scheme's driver (psycopg2, pymysql, ...) is not installed
        return (f"cannot open {_shown(uri)}: its database driver is not installed ({err}); install it, or set "
                f"tracking.enabled=false")
    except Exception as err:  # the server refused or is down, bad credentials, a malformed URI
        first = str(getattr(err, "orig", None) or err).strip().splitlines()
        return (f"cannot reach {_shown(uri)} ({first[0] if first else type(err).__name__}); start the database, "
                f"or set tracking.enabled=false")


def _shown(uri: str) -> str:
    """A store's URI without its password."""
    from kareus.tracking.records import redacted

    return redacted(uri)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (relative or absolute), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def resolve_uri(uri: str, base_dir: str | os.PathLike | None = None) -> str:
    """Make a local store URI absolute against ``base_dir`` and create its folder.

    Worker processes and Hydra jobs may run elsewhere; an absolute URI means the same store for all.
    """
    base = Path(base_dir or os.getcwd())
    path = sqlite_path(uri)
    if path is not None:
        query = uri.split("?", 1)[1] if "?" in uri else ""
        path = path if path.is_absolute() else (base / path)
        path = path.resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return "sqlite:///" + str(path) + (f"?{query}" if query else "")
    return uri


def resolve_artifact_location(location: str | None, uri: str, base_dir: str | os.PathLike | None = None) -> str | None:
    """Artifact root for a new experiment: a URI as given, a local path made absolute, None for servers."""
    if not location:
        return None
    if urlparse(location).scheme not in ("", "file"):
        return location  # s3://, gs://, mlflow-artifacts:/ ...
    if is_remote(uri):
        return None  # a tracking server serves artifacts from its own root
    path = Path(location[len("file://"):] if location.startswith("file://") else location)
    path = (path if path.is_absolute() else Path(base_dir or os.getcwd()) / path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


# (module, pip package) that MLflow's artifact repository for a scheme imports when it first writes
_ARTIFACT_PACKAGES = {"s3": ("boto3", "boto3"), "gs": ("google.cloud.storage", "google-cloud-storage"),
                      "wasbs": ("azure.storage.blob", "azure-storage-blob"),
                      "abfss": ("azure.storage.filedatalake", "azure-storage-file-datalake"),
                      "hdfs": ("pyarrow", "pyarrow"), "viewfs": ("pyarrow", "pyarrow"), "oss": ("oss2", "oss2"),
                      "sftp": ("pysftp", "pysftp")}


def artifact_location_problem(location: str | None, uri: str) -> str | None:
    """Why a new experiment's artifact root would fail at the run's first artifact (None if it would
    not): a local folder that cannot be made, or a cloud scheme whose client library is missing.
    MLflow raised that mid-run, after creating the run, and kept the location for the experiment."""
    if not location or is_remote(uri):
        return None  # a tracking server serves artifacts from its own root
    scheme = urlparse(location).scheme
    if scheme in ("", "file"):
        from kareus.paths import folder_problem

        path = Path(location[len("file://"):] if location.startswith("file://") else location)
        problem = folder_problem(path if path.is_absolute() else Path(base_dir()) / path)
        return None if problem is None else f"{problem}; choose another folder"
    if scheme not in _ARTIFACT_PACKAGES:
        return None
    import importlib.util

    module, package = _ARTIFACT_PACKAGES[scheme]
    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except ModuleNotFoundError:  # a parent package (google.cloud) is missing
        pass
    return f"{location} needs the package {package} for MLflow's {scheme}:// artifacts; install it, or give a local folder"


def is_lock_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in _LOCK_ERRORS)


def retry(fn: Callable[..., T], *args: Any, attempts: int = 10, delay_s: float = 0.05, **kwargs: Any) -> T:
    """Call ``fn`` (with signals deferred), retrying with jittered back-off while SQLite reports a
    lock (other writers)."""
    for attempt in range(attempts):
        try:
            with signals_deferred():
                return fn(*args, **kwargs)
        except Exception as exc:  # MlflowException wraps the sqlalchemy OperationalError
            if attempt == attempts - 1 or not is_lock_error(exc) or signal_pending():
                raise  # a Ctrl-C or SIGTERM held by an enclosing block: stop now, not after the back-off
            time.sleep(delay_s * (2 ** attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Exclusive file lock beside a SQLite store (no-op for other stores or without fcntl)."""
    path = sqlite_path(uri)
    try:
        import fcntl
    except ImportError:  # not POSIX
        fcntl = None
    if path is None or fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def client_for(uri: str, telemetry: bool = False):
    """One MlflowClient per URI per process; its store (and SQLite schema) is created under the lock."""
    client = _clients.get(uri)
    if client is None:
        import_mlflow(telemetry)
        from mlflow.tracking import MlflowClient

        # the constructor may already open (and create) the store: under the lock, and with Ctrl-C and
        # SIGTERM held, since a stop amid its schema migrations left a store no later run could open
        with store_lock(uri), signals_deferred():
            client = MlflowClient(tracking_uri=uri)
            retry(client.search_experiments, max_results=1)  # forces creation/migration of the store
        _clients[uri] = client
    return client


def experiment_id(uri: str, name: str, artifact_location: str | None = None, telemetry: bool = False) -> str:
    """Id of experiment ``name``, created once, safely across processes. A deleted one is refused, as
    MLflow's ``set_experiment`` refuses it: restoring it would bring back every run the user deleted.
    New and existing experiments get the tags that open the UI on their runs (kareus.tracking.ui)."""
    from kareus.tracking import ui

    key = (uri, name)
    if key in _experiments:
        return _experiments[key]
    client = client_for(uri, telemetry)
    with store_lock(uri):
        exp = retry(client.get_experiment_by_name, name)
        if exp is None:
            try:
                exp_id = retry(client.create_experiment, name, artifact_location=artifact_location)
            except Exception as exc:
                if "already exists" not in str(exc).lower() and "resource_already_exists" not in str(exc).lower():
                    raise
                exp_id = retry(client.get_experiment_by_name, name).experiment_id
        else:
            exp_id = exp.experiment_id
            if exp.lifecycle_stage == "deleted":
                from kareus.errors import KareusError

                raise KareusError(f"tracking.experiment: {name!r} is deleted in {_shown(uri)}; restore it "
                                  f"(mlflow experiments restore --experiment-id {exp_id}), delete it for good "
                                  f"(mlflow gc), or choose another tracking.experiment")
        _add_ui_tags(client, exp_id, ui.experiment_tags(exp.tags if exp is not None else {}))
    _experiments[key] = exp_id
    return exp_id


def _add_ui_tags(client: Any, exp_id: str, tags: dict[str, str]) -> None:
    """Set the experiment's UI tags one by one, after it exists: how the UI opens is no reason to fail a
    run, so a refusal (a server's permissions, a store that reserves ``mlflow.`` tags) is a warning."""
    for tag, value in tags.items():
        try:
            retry(client.set_experiment_tag, exp_id, tag, value)
        except Exception as exc:  # MlflowException: permission denied, a reserved key
            log.warning("could not set the tag %s of experiment %s: %s", tag, exp_id, exc)


def connect(uri: str, experiment: str, artifact_location: str | None = None,
            base_dir: str | os.PathLike | None = None, telemetry: bool = False) -> tuple[Any, str, str]:
    """Resolve paths, open the store, ensure the experiment: ``(client, experiment_id, absolute_uri)``."""
    abs_uri = resolve_uri(uri, base_dir)
    art = resolve_artifact_location(artifact_location, abs_uri, base_dir)
    exp_id = experiment_id(abs_uri, experiment, art, telemetry)
    return client_for(abs_uri, telemetry), exp_id, abs_uri


def base_dir() -> str:
    """The directory the user started in (Hydra's original cwd if a Hydra job changed it)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return HydraConfig.get().runtime.cwd
    except Exception:  # hydra absent or not configured
        pass
    return os.getcwd()
