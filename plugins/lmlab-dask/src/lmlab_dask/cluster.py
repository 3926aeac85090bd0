"""The Dask cluster a preparation or a sweep runs on: one reached by address and left running, or a
local one started here (single-threaded worker processes) and stopped with the command."""

import logging
import os
import socket

from lmlab.api import UserError

CONNECT_TIMEOUT_S = 10.0


class Cluster:
    def __init__(self, scheduler: str | None, n: int):
        self.scheduler, self.n = scheduler, max(1, n)
        self.client = None  # the distributed.Client, once connected
        self.local = None  # the LocalCluster this process started, if any
        self._environ: dict[str, str | None] = {}  # this process's values of what Dask's nannies overwrite

    def connect(self):
        """The client, connecting (or starting the local cluster) on first use; an address that cannot
        be reached is bad input (exit 2) within ``CONNECT_TIMEOUT_S``."""
        if self.client is not None:
            return self.client
        try:
            from distributed import Client, LocalCluster
        except ImportError as exc:  # a dependency of this distribution, missing: an install step, not a crash
            raise UserError(f"Dask's distributed scheduler cannot be imported ({exc}); pip install lmlab-dask",
                            key="--executor") from None

        if self.scheduler is None:
            # Dask's dashboard needs bokeh; without it the local cluster serves none.
            dashboard = ":0" if has_bokeh() else None
            self._environ = _nanny_environ()
            self.local = LocalCluster(n_workers=self.n, threads_per_worker=1, processes=True,
                                      dashboard_address=dashboard, silence_logs=logging.ERROR)
            _restore(self._environ)
            self.client = Client(self.local)
        else:
            _probe(self.scheduler)
            try:
                self.client = Client(self.scheduler, timeout=CONNECT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - unreachable, refused, malformed: all bad input
                raise UserError(f"cannot reach the Dask scheduler at {self.scheduler!r} within "
                                f"{CONNECT_TIMEOUT_S:g} s ({type(exc).__name__}: {exc})", key="--scheduler") from None
        return self.client

    def workers(self) -> dict[str, dict]:
        """Worker address → what the scheduler knows of it (``nthreads``, ``resources``, ...)."""
        return dict(self.connect().scheduler_info(n_workers=-1).get("workers", {}))

    def dashboard(self) -> str | None:
        # A remote scheduler's dashboard is its own affair; a local one needs bokeh here.
        if self.local is not None and not has_bokeh():
            return None
        return self.client.dashboard_link

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.local is not None:
            self.local.close()
            self.local = None
            _restore(self._environ)  # again: a nanny that restarted a lost worker set them again


def _probe(address: str) -> None:
    """A TCP scheduler address where nothing listens is refused at once, rather than after Dask's
    connection retries have spent ``CONNECT_TIMEOUT_S``."""
    scheme, _, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    if scheme not in ("", "tcp") or not port.isdigit():
        return  # tls://, ucx://, inproc://: Dask's own connection says what is wrong
    try:
        socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise UserError(f"cannot reach the Dask scheduler at {address!r}: {exc.strerror or exc}",
                        key="--scheduler") from None


def has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None


def _nanny_environ() -> dict[str, str | None]:
    """This process's values of the variables a Dask nanny writes into the environment of the process
    that starts it, for its worker to inherit (``distributed.nanny.pre-spawn-environ``:
    OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, ...). Left there, they would make every later child of this
    process (a training run's, a test's) single-threaded."""
    import dask

    # and PYTHONHASHSEED, and the parent's pid, which they set beside those
    keys = set(dask.config.get("distributed.nanny.pre-spawn-environ", None) or {}) | {"PYTHONHASHSEED",
                                                                                       "__DASK_PARENT_PID"}
    return {key: os.environ.get(key) for key in keys}


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
