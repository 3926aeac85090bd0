"""The collective-timeout diagnosis: which collective a multi-process run was waiting in, and which
rank was late (each rank records the step it begins, :func:`heartbeat`)."""

import json
import re
import time
from pathlib import Path

from lmlab.api.monitor import Diagnosis, Fix
from lmlab.api.parallel import LaunchOptions

_TIMEOUT = re.compile(r"timed out|timeout|watchdog caught collective|NCCL|Gloo|ProcessGroup|"
                      r"Connection (closed|reset) by peer", re.I)
#: Environment settings worth checking when a collective times out, and why.
COLLECTIVE_SETTINGS = (
    ("NCCL_DEBUG=INFO", "NCCL logs each rank's transport and the collective it waits in"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "a timed-out NCCL collective aborts the process instead of hanging"),
    ("TORCH_DISTRIBUTED_DEBUG=DETAIL", "torch checks that every rank calls the same collectives in order"),
    ("NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME", "the network interface the ranks reach each other on"),
    ("MASTER_ADDR / MASTER_PORT", "where rank 0 listens (every node must reach it)"),
)
#: Where ranks record the step they reached, for naming the late one (``heartbeat``).
HEARTBEAT_DIR = ".ranks"


def is_collective_timeout(exc: BaseException) -> bool:
    import torch.distributed as dist

    backend_errors = tuple(c for c in (getattr(dist, "DistBackendError", None), getattr(dist, "DistError", None)) if c)
    return any((backend_errors and isinstance(e, backend_errors)) or
               (isinstance(e, (RuntimeError, TimeoutError)) and _TIMEOUT.search(str(e))) for e in exception_chain(exc))


def collective_timeout(exc: BaseException, run, run_dir: Path | None, late=None) -> Diagnosis:
    """``late``: :func:`late_ranks` as read when the failure happened (before the process group was
    torn down, which may wait for the late rank); read now when not given."""
    first = str(exc).splitlines()[0][:300]
    evidence = [first]
    collective = _which_collective(exc)
    if collective:
        evidence.append(f"collective: {collective}")
    if late is None and run_dir is not None:
        late = late_ranks(run_dir)
    cause = "a collective operation timed out: some process did not join it in time"
    joined = re.search(r"(\d+)/(\d+) clients joined", str(exc))
    if joined:
        cause = (f"at start-up only {joined.group(1)} of {joined.group(2)} processes joined the process group in "
                 "time: the others did not start, or cannot reach rank 0")
    elif late:
        ranks, detail = late
        cause = f"a collective operation timed out waiting for rank {', '.join(map(str, ranks))}"
        evidence.extend(detail)
    fixes = [Fix(f"{setting}: {why}") for setting, why in COLLECTIVE_SETTINGS]
    launch = run.options("parallel") if run is not None and run.uses("parallel") else None
    if isinstance(launch, LaunchOptions):
        fixes.insert(0, Fix("wait longer, if the late rank is slow rather than stuck (a long first step, "
                            "a slow file system)", "parallel.timeout_s", max(60.0, 4 * float(launch.timeout_s))))
    return Diagnosis("collective-timeout", cause, evidence=evidence, fixes=fixes)


#: Python frames a collective is called from → what it was (innermost match wins).
_COLLECTIVE_FRAMES = (("barrier", "a barrier"), ("all_gather", "an all-gather"), ("broadcast", "a broadcast"),
                      ("reduce_scatter", "a reduce-scatter"), ("all_reduce", "an all-reduce"),
                      ("reduce", "a reduction (the strategy's reduce)"), ("save_checkpoint", "the checkpoint's gather"),
                      ("backward", "the gradient all-reduce of the backward pass"),
                      ("setup_environment", "the process group's start-up"))


def _which_collective(exc: BaseException) -> str | None:
    """What was in flight, from the innermost Python frame that names a collective (the backend's
    message says only recv/send for most), else from the message."""
    import traceback

    for e in exception_chain(exc):
        frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
        for frame in reversed(frames):
            for needle, what in _COLLECTIVE_FRAMES:
                if needle in frame.name:
                    return f"{what} ({frame.name} at {Path(frame.filename).name}:{frame.lineno})"
    named = re.search(r"(all_?reduce|allgather|all_gather|broadcast|reduce_scatter|barrier)", str(exc), re.I)
    return named.group(1) if named else None


def heartbeat(run_dir: Path, rank: int, step: int) -> None:
    """Record that ``rank`` has completed ``step`` optimizer steps and begins the next (whose
    collectives it is about to join)."""
    folder = run_dir / HEARTBEAT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rank{rank}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "step": step, "time": time.time()}))
    tmp.replace(folder / f"rank{rank}.json")


#: Seconds after the first rank that another must begin the same step to count as late.
LATE_AFTER_S = 5.0


def late_ranks(run_dir: Path) -> tuple[list[int], list[str]] | None:
    """The ranks that began the fewest steps, or (all at the same step) began it more than
    ``LATE_AFTER_S`` after the first, with each rank's last record; None without a late one."""
    folder = run_dir / HEARTBEAT_DIR
    records = []
    for path in sorted(folder.glob("rank*.json")) if folder.is_dir() else ():
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if len(records) < 2:
        return None
    lowest = min(r["step"] for r in records)
    first = min(r["time"] for r in records if r["step"] == lowest)
    if any(r["step"] != lowest for r in records):
        late = [r["rank"] for r in records if r["step"] == lowest]
    else:  # read after the late rank caught up (the process group's teardown waited for it)
        late = [r["rank"] for r in records if r["time"] - first > LATE_AFTER_S]
    if not late:
        return None
    detail = [f"rank {r['rank']} began step {r['step'] + 1} ({r['step']} completed)"
              + (f", {r['time'] - first:.0f} s after the first rank" if r["time"] - first > LATE_AFTER_S else "")
              for r in sorted(records, key=lambda r: r["rank"])]
    return sorted(late), detail


def exception_chain(exc: BaseException):
    """``exc`` and the exceptions it was raised from or during, innermost last."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
