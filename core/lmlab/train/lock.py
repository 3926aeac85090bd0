"""One live run per run folder: an advisory lock file that names its holder.

``lmlab run`` takes ``<run folder>/.lmlab.lock`` before it touches the folder (``--overwrite`` and
starting over delete files) and holds it until the variant ends; a second live run into the same
folder is refused, naming the host and process that hold it. The lock is ``flock(2)`` on the file,
which the kernel releases when its process dies, so a lock left by a killed run (``kill -9``, a
node that crashed) is simply taken over; the file's text (host, pid, start, command) is only there
to tell the user who holds a live one. Where the file system has no ``flock`` (some network mounts),
the holder's pid is checked instead: a dead process on this host holds nothing.

``--jobs N`` holds the locks in the parent and hands each child its variant's lock as an inherited
descriptor (``LMLAB_RUN_LOCK_FD``): the same open file, so the lock never lapses between the two.
Nothing here imports torch.
"""

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

from lmlab.errors import UserError

NAME = ".lmlab.lock"
INHERITED = "LMLAB_RUN_LOCK_FD"  # "fd:path" of a lock the parent process holds for this one

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the pid check alone
    fcntl = None


class RunLock:
    """The lock on one run folder. ``acquire`` raises UserError (exit 2) when a live run holds it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / NAME
        self.fd: int | None = None
        self.owned = False  # False: inherited from the parent, which deletes the file
        self.took_over: dict | None = None  # the holder of a stale lock file this one replaced
        self.created = False  # the folder did not exist before: removed again if nothing was written

    def acquire(self) -> "RunLock":
        if self._adopt():
            return self
        self.created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                outcome = _try_lock(fd)
                before = _read(fd)
                if outcome == "held" or (outcome == "unsupported" and _alive(before)):
                    raise UserError(f"is in use by another live run ({describe(before)}); wait for it to end, "
                                    "or stop it, before running into this folder", key=str(self.run_dir))
                # The previous holder may have deleted the file between our open and our lock: then
                # we hold a lock on a file no one else can find; start again on the new one.
                if os.fstat(fd).st_ino != _inode(self.path):
                    os.close(fd)
                    continue
            except BaseException:
                os.close(fd)
                raise
            self.fd, self.owned = fd, True
            self.took_over = before or None
            _write(fd, holder())
            return self

    def _adopt(self) -> bool:
        """Whether the parent process (``--jobs``) handed this one the lock of this folder."""
        handed = os.environ.get(INHERITED, "")
        fd_text, _, path = handed.partition(":")
        if not fd_text.isdigit() or Path(path) != self.path.resolve():
            return False
        fd = int(fd_text)
        try:
            if os.fstat(fd).st_ino != _inode(self.path):
                return False
        except OSError:
            return False
        self.fd, self.owned = fd, False
        return True

    def handoff_env(self) -> tuple[dict, int]:
        """The environment entry and descriptor that hand this lock to a child process."""
        os.set_inheritable(self.fd, True)
        return {INHERITED: f"{self.fd}:{self.path.resolve()}"}, self.fd

    def release(self) -> None:
        if self.fd is None:
            return
        if self.owned:
            # Deleted while still locked, so that a waiting process never locks a file that is
            # about to disappear (it re-checks the inode after locking).
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None
        if self.created:
            try:  # a variant refused before it wrote anything leaves no empty folder behind
                self.run_dir.rmdir()
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def live_holder(run_dir: Path) -> dict | None:
    """Who holds ``run_dir``'s lock now (host, pid, start, command), or None when no live run does;
    takes nothing (``lmlab run --status``)."""
    path = Path(run_dir) / NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        info = _read(fd)
        outcome = _try_lock(fd)
        if outcome == "locked":
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return (info or {}) if outcome == "held" or _alive(info) else None
    finally:
        os.close(fd)


def holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["lmlab", *sys.argv[1:]])[:500]}


def describe(info: dict | None) -> str:
    if not info:
        return "holder unknown"
    return f"pid {info.get('pid')} on {info.get('host')}, since {info.get('started')}: {info.get('command', '')}".rstrip(": ")


def _try_lock(fd: int) -> str:
    """"locked" (ours now), "held" (by a live process) or "unsupported" (no flock here)."""
    if fcntl is None:
        return "unsupported"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "locked"
    except BlockingIOError:
        return "held"
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return "unsupported"
        raise


def _alive(info: dict | None) -> bool:
    """Without flock: whether the recorded holder may still be running (another host: assume so)."""
    if not info or not isinstance(info.get("pid"), int):
        return False
    if info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return info["pid"] != os.getpid()


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _read(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode("utf-8")) if data.strip() else None
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def _write(fd: int, info: dict) -> None:
    data = (json.dumps(info) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
