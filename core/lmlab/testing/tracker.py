"""Conformance checks of tracker plugins: a run tracked in a sandbox, then inspected.

The tracker runs once per :class:`TrackerSubject`, in a fresh interpreter, as ``lmlab run`` drives it:
``start(RunInfo)``, a few ``log`` calls and ``finish`` for a new run, again for the same run resumed
(``RunInfo.resume``), then ``closing_note`` on a fresh instance. A fresh interpreter, because a tracker
may start helper processes (wandb's service) that outlive the run and remember the environment they
started in, and because the session changes what is process-wide: the environment, the working
folder, an audit hook and the socket functions.

The sandbox: the run folder is the only place the tracker may write. HOME, the XDG folders, TMPDIR and
the working folder point into an empty folder beside it, which must stay empty; an audit hook records
any file the interpreter opens for writing, creates, renames or removes outside the run folder, in
any folder (files Python's import system caches are ignored); connections and name lookups of any host
but the loopback are refused and recorded in that interpreter (a helper process in another language is
beyond the hook: its files still land in the sandbox, but its connections are not seen). Credential variables (``WANDB_API_KEY``, ``HF_TOKEN``, ...)
hold marker strings, and no marker may appear in any file written or in the closing note. Inherited
``WANDB_*`` variables are dropped, so the result does not depend on the caller's W&B settings; ``env``
adds variables of the caller's choice.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lmlab.testing import generic
from lmlab.testing.common import Subject, fail

#: Credential variables set to markers while the tracker runs.
SECRET_VARIABLES = ("WANDB_API_KEY", "HF_TOKEN", "COMET_API_KEY", "NEPTUNE_API_TOKEN", "MLFLOW_TRACKING_PASSWORD")
SANDBOX_VARIABLES = ("HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "TMPDIR",
                     "TMP", "TEMP")

# Run in the child interpreter. Only lmlab.api is imported besides the plugin: lmlab.testing imports torch.
_CHILD = r'''
import errno, json, os, pickle, socket, sys
from pathlib import Path

with open(sys.argv[1], "rb") as f:
    sys.path[:0] = pickle.load(f)
    cls, name, options, run_dir = pickle.load(f)
from lmlab.api import RunInfo

run_dir = os.path.realpath(run_dir)
report = {"error": None, "note": None, "note_type": None, "note_error": None, "network": [], "writes": []}
watching = True
WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

def note_write(what, path):
    if path is None or isinstance(path, int):
        return
    real = os.path.realpath(os.fsdecode(os.fspath(path)))
    if real == run_dir or real.startswith(run_dir + os.sep) or real.startswith(("/dev/", "/proc/")):
        return
    if "__pycache__" in real.split(os.sep):
        return  # the import system caching bytecode of a module imported during the run
    if len(report["writes"]) < 20:
        report["writes"].append(f"{what} {real}")

def hook(event, args):
    if not watching:
        return
    try:
        if event == "open" and isinstance(args[2], int) and args[2] & WRITE:
            note_write("wrote", args[0])
        elif event in ("os.mkdir", "os.remove", "os.rmdir", "os.truncate", "os.symlink", "os.link"):
            note_write(event.split(".")[1], args[1] if event in ("os.symlink", "os.link") else args[0])
        elif event == "os.rename":
            note_write("renamed", args[0])
            note_write("renamed to", args[1])
        elif event == "shutil.copyfile":
            note_write("copied to", args[1])
    except Exception:
        pass  # an exception in an audit hook would abort the tracker's own call

sys.addaudithook(hook)

def local(host):
    host = host.decode() if isinstance(host, bytes) else host
    return host in (None, "", "localhost", "::1", "0.0.0.0") or str(host).startswith("127.") \
        or str(host).endswith(".localhost")

real_connect, real_connect_ex, real_getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

def refuse(host, port):
    if len(report["network"]) < 20:
        report["network"].append(f"{host}:{port}")
    return OSError(errno.ENETUNREACH, "no network while lmlab.testing checks a tracker")

def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not local(address[0]):
        raise refuse(*address[:2])
    return real_connect(self, address)

def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not local(address[0]):
        refuse(*address[:2])
        return errno.ENETUNREACH
    return real_connect_ex(self, address)

def getaddrinfo(host, port, *args, **kwargs):
    if not local(host):
        refuse(host, port)
        raise socket.gaierror(socket.EAI_NONAME, "no network while lmlab.testing checks a tracker")
    return real_getaddrinfo(host, port, *args, **kwargs)

socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo

cls.name = name
config = {"name": "kit", "seed": 0, "tracker": {"use": name}, "train": {"max_steps": 4, "lr": 0.001}}
flat = {"name": "kit", "seed": 0, "tracker.use": name, "train.max_steps": 4, "train.lr": 0.001, "variant": "kit"}
plugins = {"tracker": {"name": name, "distribution": "(under test)", "version": ""}}
environment = {"lmlab": "0", "git": None, "torch": "0", "lightning": "0", "device": "cpu"}
stage = "constructing the plugin"
try:
    for resume, status, steps in ((False, "completed", (1, 2, 3)), (True, "interrupted", (4,))):
        tracker = cls(options)
        run = "a resumed run" if resume else "a new run"
        stage = f"start() of {run}"
        tracker.start(RunInfo(run_dir=Path(run_dir), group="kit", name="seed=0", config=config, flat_config=flat,
                              plugins=plugins, resume=resume, variant="kit", environment=environment))
        for step in steps:
            stage = f"log(step={step}) of {run}"
            tracker.log({"train/loss": 4.0 / step, "lr": 1e-3 * step, "tokens": 512.0 * step}, step)
        stage = f"finish(status={status!r}) of {run}"
        tracker.finish({"status": status, "steps": steps[-1], "val_loss": 2.5}, status)
except BaseException as exc:
    report["error"] = f"{stage} raised {type(exc).__name__}: {exc}"
try:
    note = cls(options).closing_note([Path(run_dir)])
    report["note_type"] = type(note).__name__
    report["note"] = note if isinstance(note, str) else repr(note)
except BaseException as exc:
    report["note_error"] = f"{type(exc).__name__}: {exc}"
watching = False
with open(sys.argv[2], "w") as f:
    json.dump(report, f)
'''


class TrackerSubject(Subject):
    slot = "tracker"

    def __init__(self, plugin, options=None, *, env: dict[str, str] | None = None, **settings):
        super().__init__(plugin, options, **settings)
        self.env = dict(env or {})
        self._session: dict | None = None

    def session(self) -> dict:
        """What the sandboxed run observed (run once per subject, shared by its checks)."""
        if self._session is None:
            self._session = _run(self)
        if self._session.get("crash"):
            fail(f"the tracked run could not take place: {self._session['crash']}")
        return self._session


def _markers() -> dict[str, str]:
    return {name: f"lmlab-kit-secret-{name.lower()}-4f1c9e" for name in SECRET_VARIABLES}


def _run(subject: TrackerSubject) -> dict:
    name = getattr(subject.cls, "name", "") or subject.cls.__name__
    root = Path(tempfile.mkdtemp(prefix="lmlab-kit-tracker-"))
    try:
        run_dir = root / "runs" / "kit" / "seed=0"
        run_dir.mkdir(parents=True)
        (run_dir / "manifest.toml").write_text('name = "kit"\n')  # the core writes it before start()
        outside = root / "outside"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in SECRET_VARIABLES}
        for variable in SANDBOX_VARIABLES:
            folder = outside / variable.lower()
            folder.mkdir(parents=True)
            env[variable] = str(folder)
        (outside / "cwd").mkdir()
        env.update(_markers())
        env.update(subject.env)
        kit = root / "kit"
        kit.mkdir()
        try:
            payload = pickle.dumps([p for p in sys.path if p]) + pickle.dumps(
                (subject.cls, name, subject.options, str(run_dir)))
        except Exception as exc:
            return {"crash": f"the tracker's class and options do not pickle ({type(exc).__name__}: {exc}); the "
                             "kit runs it in a fresh interpreter, so the class must be importable by name"}
        (kit / "in.pickle").write_bytes(payload)
        done = subprocess.run([sys.executable, "-c", _CHILD, str(kit / "in.pickle"), str(kit / "out.json")],
                              env=env, cwd=outside / "cwd", capture_output=True, text=True, timeout=300)
        if not (kit / "out.json").is_file():
            tail = " ".join(done.stderr.strip().splitlines()[-3:])
            return {"crash": f"the interpreter running it exited with status {done.returncode}: {tail}"}
        report = json.loads((kit / "out.json").read_text())
        # Files, and folders left empty: what a run leaves behind outside its folder.
        left = (p for folder in outside.iterdir() for p in folder.rglob("*"))
        report["outside"] = sorted(str(p.relative_to(outside)) for p in left
                                   if p.is_file() or p.is_symlink() or (p.is_dir() and not any(p.iterdir())))
        sandbox = os.path.realpath(outside) + os.sep
        report["writes"] = [w.replace(sandbox, "<sandbox>/") for w in report["writes"]]
        report["secrets"] = _secrets_in([run_dir, outside], root)
        return report
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _secrets_in(folders: list[Path], root: Path) -> list[str]:
    found = []
    markers = {variable: marker.encode() for variable, marker in _markers().items()}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if not path.is_file() or path.is_symlink():
                continue
            data = path.read_bytes()
            found += [f"{path.relative_to(root)} holds ${variable}" for variable, marker in markers.items()
                      if marker in data]
    return found


def lifecycle(subject: TrackerSubject) -> None:
    """``start(RunInfo)``, ``log(metrics, step)`` three times and ``finish(summary, "completed")`` of a
    new run, then ``start`` of the same run resumed (``RunInfo.resume`` True, same ``run_dir``),
    ``log`` and ``finish(summary, "interrupted")``, on fresh instances, never raise."""
    error = subject.session()["error"]
    if error:
        fail(error)


def closing_note(subject: TrackerSubject) -> None:
    """``closing_note([run_dir])``, on a fresh instance after the runs, returns a str or None."""
    session = subject.session()
    if session["note_error"]:
        fail(f"closing_note([run_dir]) raised {session['note_error']}")
    if session["note_type"] not in ("str", "NoneType"):
        fail(f"closing_note([run_dir]) returned {session['note']} of type {session['note_type']}, not a str or None")


def run_dir_only(subject: TrackerSubject) -> None:
    """Nothing is written outside the run folder: the sandbox's HOME, XDG folders, TMPDIR and working
    folder are empty after the runs (helper processes included), and the interpreter opened for writing,
    created, renamed or removed no path outside the run folder, even one it removed again."""
    session = subject.session()
    problems = []
    if session["outside"]:
        problems.append("left behind in the sandbox's $HOME, XDG folders, $TMPDIR or working folder: "
                        + _some(session["outside"]))
    if session["writes"]:
        problems.append("the interpreter " + _some(session["writes"]))
    if problems:
        fail("wrote outside the run folder: " + "; ".join(problems) + "; keep everything under RunInfo.run_dir")


def _some(items: list[str], shown: int = 3) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def no_secrets(subject: TrackerSubject) -> None:
    """The marker values of the credential variables (``WANDB_API_KEY``, ``HF_TOKEN``, ...) appear in no
    file written (under the run folder or outside it) and not in the closing note: a run folder is
    shared and archived, and a credential in it leaks."""
    session = subject.session()
    if session["secrets"]:
        fail("a credential from the environment was written to a file: " + "; ".join(session["secrets"][:3]))
    leaked = [v for v, marker in _markers().items() if marker in (session["note"] or "")]
    if leaked:
        fail(f"the closing note shows ${leaked[0]}")


def offline(subject: TrackerSubject) -> None:
    """The tracker's interpreter connects to, or looks up, no host other than the loopback during the
    runs and the closing note (a check, a test, an offline run must not need a network); helper
    processes that talk to the tracker over the loopback are fine."""
    network = subject.session()["network"]
    if network:
        fail(f"tried to reach the network: {', '.join(network[:3])}; offline runs must not need it")


#: name → check, in the order ``check_tracker`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "lifecycle": lifecycle,
    "closing_note": closing_note,
    "run_dir_only": run_dir_only,
    "no_secrets": no_secrets,
    "offline": offline,
}
