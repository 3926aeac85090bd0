"""Isolation for every test of the repository (the core's and each plugin's), set up before any fixture
of a wider scope runs: one token and conversion cache for the session (tokenising a corpus or
converting a GGUF file is paid once, never in the user's own cache), offline W&B.

The suite runs on one pytest-xdist worker per core. Each worker is held to its own core, and so are
the processes its tests start (one thread each), because N processes that each start as many threads
as there are cores run many times slower than one. A test marked ``exclusive`` (it starts several
processes, or waits on a timeout that a loaded machine would miss) waits until no other test runs,
keeps the others waiting, and has every core, as it would in a serial run."""

import contextlib
import fcntl
import os
from pathlib import Path

import pytest

EXCLUSIVE = ("exclusive: starts several processes (or waits on a timeout): runs with no other test beside it, "
             "on every core")


@pytest.fixture(scope="session", autouse=True)
def _isolated_session(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "lmlab-cache"))
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        yield


class Room:
    """A readers-writer lock between the workers: ordinary tests share the room, an exclusive test
    has it alone. The turnstile gives a waiting exclusive test precedence, so that workers which
    keep starting ordinary tests never starve it (flock itself favours no one)."""

    def __init__(self, folder: Path, core: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.turnstile = open(folder / "turnstile.lock", "a+")
        self.room = open(folder / "room.lock", "a+")
        self.core, self.every_core = core, os.sched_getaffinity(0)
        self.own_core()

    def own_core(self) -> None:
        os.sched_setaffinity(0, {self.core})
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
        _torch_threads(1)

    def every_core_of_the_machine(self) -> None:
        os.sched_setaffinity(0, self.every_core)
        os.environ.pop("OMP_NUM_THREADS", None)
        os.environ.pop("MKL_NUM_THREADS", None)
        _torch_threads(len(self.every_core))

    @contextlib.contextmanager
    def shared(self):
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.room, fcntl.LOCK_SH)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.room, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def alone(self):
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.room, fcntl.LOCK_EX)
            self.every_core_of_the_machine()
            try:
                yield
            finally:
                self.own_core()
                fcntl.flock(self.room, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)


def _torch_threads(n: int) -> None:
    import sys

    if "torch" in sys.modules:  # otherwise torch starts with the affinity's cores and OMP_NUM_THREADS
        sys.modules["torch"].set_num_threads(n)


_ROOM = pytest.StashKey[Room]()


def pytest_configure(config):
    config.addinivalue_line("markers", EXCLUSIVE)
    worker = getattr(config, "workerinput", None)
    if worker is None or int(worker.get("workercount", 1)) < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    number = int(worker["workerid"].removeprefix("gw"))
    # xdist gives each worker a basetemp inside the run's own: the room is shared by this run's workers only.
    config.stash[_ROOM] = Room(Path(config.option.basetemp).parent / "room", cores[number % len(cores)])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    room = item.config.stash.get(_ROOM, None)
    if room is None:
        return (yield)
    with room.alone() if item.get_closest_marker("exclusive") else room.shared():
        return (yield)
