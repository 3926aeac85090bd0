"""Writing the run folder: every file is replaced atomically, so a crash never leaves half a file."""

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import tomli_w

from lmlab.errors import UserError

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; a run folder is meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json_text(obj, indent=2) + "\n").encode())


def json_text(obj: Any, indent: int | None = None) -> str:
    """Strict JSON: NaN and infinity, which JSON has no words for, become null (the run's status or
    error says why a number is missing)."""
    return json.dumps(finite(obj), indent=indent, default=str, allow_nan=False)


def finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def toml_text(obj: dict) -> str:
    return tomli_w.dumps(_drop_none(obj))


def write_toml(path: Path, obj: dict) -> None:
    atomic_write_bytes(path, toml_text(obj).encode())


def _drop_none(obj):
    # TOML has no null; an option left at None is its default, so leaving it out reads back the same.
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, appended and flushed as it goes."""

    def __init__(self, path: Path, keep_until_step: int | None = None):
        self.path = path
        if keep_until_step is not None and path.exists():
            # Resuming: drop what the interrupted run logged after its last checkpoint.
            kept = [line for line in path.read_bytes().decode("utf-8", "replace").splitlines()
                    if line.strip() and _step(line) is not None and _step(line) <= keep_until_step]
            atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())
        elif keep_until_step is None:
            path.unlink(missing_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json_text(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by a kill: drop it


def load_json_object(path: Path, what: str, remedy: str) -> dict | None:
    """A JSON object file of lmlab's (a run's summary.json, a sweep's sweep.json); None when there is
    none, a UserError naming it when it is damaged (not UTF-8, not JSON, not an object)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"cannot be read ({exc.strerror})", key=str(path)) from None
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        why = "not UTF-8 text"
    except ValueError:
        why = "not valid JSON"
    else:
        if isinstance(obj, dict):
            return obj
        why = f"a JSON {type(obj).__name__}, not an object"
    raise UserError(f"is not a readable {what} ({why}); {remedy}", key=str(path))


def load_summary(run_dir: Path, remedy: str) -> dict | None:
    return load_json_object(run_dir / "summary.json", "run summary", remedy)


def read_metrics(path: Path) -> list[dict]:
    records = []
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill, or damaged
                continue
            if isinstance(record, dict):
                records.append(record)
    return records
