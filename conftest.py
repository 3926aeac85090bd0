"""Isolation for every test of the repository (the core's and each plugin's), set up before any fixture
of a wider scope runs: one token and conversion cache for the session (tokenising a corpus or
converting a GGUF file is paid once, never in the user's own cache), offline W&B.

The suite runs on one pytest-xdist worker per core. Each worker is held to its own core, and so are
the processes its tests start (one thread each), because N processes that each start as many threads
as there are cores run many times slower than one. A test marked ``exclusive`` (it starts several
processes, or waits on a timeout that a loaded machine would miss) waits until no other test runs,
keeps the others waiting, and has every core, as it would in a serial run; the exclusive tests are
scheduled last, as one unit, after modules holding slow tests first and the rest."""

import contextlib
import fcntl
import os
import sys
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
    if "torch" in sys.modules:  # otherwise torch starts with the affinity's cores and OMP_NUM_THREADS
        sys.modules["torch"].set_num_threads(n)


_ROOM = pytest.StashKey[Room]()
_WANDB_SERVICE = os.environ.get("WANDB_SERVICE")  # a service the developer started, if any


def pytest_configure(config):
    config.addinivalue_line("markers", EXCLUSIVE)
    worker = getattr(config, "workerinput", None)
    if worker is None or int(worker.get("workercount", 1)) < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    number = int(worker["workerid"].removeprefix("gw"))
    # xdist gives each worker a basetemp inside the run's own: the room is shared by this run's workers only.
    config.stash[_ROOM] = Room(Path(config.option.basetemp).parent / "room", cores[number % len(cores)])


def pytest_collection_modifyitems(config, items):
    """The order the workers take tests in: modules holding slow tests first, so that no long test is
    left to run alone at the end; then the other modules; then every exclusive test, which the
    scheduler below hands to one worker as one unit, so that they run one after another once the rest
    is done rather than each keeping the other worker waiting mid-way."""
    exclusive = [item for item in items if item.get_closest_marker("exclusive")]
    modules: dict = {}
    for item in items:
        if not item.get_closest_marker("exclusive"):
            modules.setdefault(item.path, []).append(item)
    slow_first = sorted(modules.values(), key=lambda tests: not any(t.get_closest_marker("slow") for t in tests))
    items[:] = [item for tests in slow_first for item in tests] + exclusive


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        from xdist.scheduler import LoadScopeScheduling  # xdist is there: it asks

        class Units(LoadScopeScheduling):
            """--dist loadfile, but every exclusive test in one unit, and each documentation page's
            examples in a unit of their own (they share the page's folder, in page order)."""
            modules, tests = _exclusive_marks(config.rootpath, config.getini("testpaths"))

            def _split_scope(self, nodeid: str) -> str:
                module, _, rest = nodeid.partition("::")
                test = rest.split("[")[0].split("::")[0]
                if module in self.modules or (module, test) in self.tests:
                    return "exclusive"
                if test == "test_the_documentation_example_runs_as_the_page_shows":
                    return rest.split("[", 1)[1].rsplit(":", 1)[0]
                return module

        return Units(config, log)
    return None


def _exclusive_marks(rootpath: Path, testpaths) -> tuple[set, set]:
    """(modules, (module, test) pairs) marked exclusive, read from the sources: xdist's controller
    sees test ids only, and pytest 9 no longer lets xdist's loadgroup mark them."""
    import ast

    modules, tests = set(), set()
    for top in testpaths:
        for path in sorted((rootpath / top).rglob("test_*.py")):
            module = str(path.relative_to(rootpath))
            try:
                tree = ast.parse(path.read_text())
            except (OSError, SyntaxError):
                continue
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets) \
                        and "mark.exclusive" in ast.unparse(node.value):
                    modules.add(module)
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and any(
                        "mark.exclusive" in ast.unparse(d) for d in node.decorator_list):
                    tests.add((module, node.name))
    return modules, tests


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    room = item.config.stash.get(_ROOM, None)
    try:
        if room is None:
            return (yield)
        with room.alone() if item.get_closest_marker("exclusive") else room.shared():
            return (yield)
    finally:
        # A test that ran W&B in this process leaves its service's address here: the lmlab processes
        # later tests start would attach to that service, where a run killed mid-test stays open.
        if os.environ.get("WANDB_SERVICE") != _WANDB_SERVICE:
            os.environ.pop("WANDB_SERVICE", None)
            if _WANDB_SERVICE is not None:
                os.environ["WANDB_SERVICE"] = _WANDB_SERVICE


def pytest_terminal_summary(terminalreporter, config):
    """How many documentation examples ran, and how many the pages mark as not run, with why."""
    ran = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
           if r.when == "call" and "test_the_documentation_example_runs_as_the_page_shows" in r.nodeid]
    if not ran:
        return
    from doc_examples import not_run_reasons

    failed = sum(r.failed for r in ran)
    reasons = not_run_reasons()
    why = "; ".join(f"{reason} ({n})" for reason, n in reasons.most_common())
    terminalreporter.write_line(f"documentation examples: {len(ran)} ran ({failed} failed), "
                                f"{sum(reasons.values())} marked not run: {why}")
