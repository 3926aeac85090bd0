"""watchdog: a run that stops making progress is caught, and where it waits is written down.

A daemon thread, started when the run begins (before the data is read), watches the time of the last
completed optimizer step. When none completes within ``timeout_s`` (before the first step, within
``startup_timeout_s``: preparing the data and building the model can take long), it writes the stack
of every thread with ``faulthandler`` to the log (stderr) and to ``stacks-<rank>.txt`` in the run
folder, and then, as configured: ``stop`` ends the run as failed with a ``hang`` diagnosis whose
evidence is the main thread's innermost frames; ``wait`` only warns, and reports again after another
full ``timeout_s`` without progress (the stacks file keeps each report, so two of them show whether
the run is stuck in one place).

In a multi-process run each process has its own watchdog and writes its own stacks file: the rank
that waits in a collective and the one that is late show up side by side.

Cost: one ``time.monotonic()`` per optimizer step; the thread wakes every second (every quarter of
the shortest limit when that is less) and reads one variable.

What counts as progress: a completed optimizer step, and also an evaluation or a checkpoint written
during training. ``timeout_s`` must cover the longest stretch between those: one step (several
micro-batches with ``grad_accum``) plus an evaluation of ``eval_steps`` batches. After the last step,
the closing evaluation over the whole validation split and the sample are watched with
``startup_timeout_s``.

Ending the run: ``RunControl.fail`` raises ``KeyboardInterrupt`` in the main thread, which happens only
once that thread runs Python code again. A thread blocked in a C call (a socket read, a lock wait
without timeout) never does; when the main thread is still at the same frame ``min(10 s, the limit)``
after the failure, the watchdog sends it a real SIGINT, which interrupts the call.
"""

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Literal

from lmlab.api import Diagnosis, Field, Fix, Monitor, Options, hookimpl

#: How many of the main thread's innermost frames the diagnosis names.
FRAMES = 6
#: Longest wait, after failing the run, for the main thread to start unwinding (see the module doc).
GRACE_S = 10.0


class WatchdogOptions(Options):
    timeout_s: float = Field(
        600.0, gt=0, help="seconds without a completed optimizer step (or evaluation, or checkpoint) that "
                          "count as a hang, once the first step is done")
    startup_timeout_s: float = Field(
        1800.0, gt=0, help="the same limit before the first step (reading and preparing the data, building "
                           "the model) and after the last one (the closing evaluation)")
    action: Literal["stop", "wait"] = Field(
        "stop", help="on a hang, after writing every thread's stack: stop (the run fails with a hang "
                     "diagnosis) or wait (warn, and report again after another timeout)")


class Watchdog(Monitor):
    """Writes every thread's stack when no step completes in time, then stops the run or warns."""

    Options = WatchdogOptions
    api = ">=1.20,<2"  # RunControl.run; lmlab.api.monitor (1.7)

    def __init__(self, options=None):
        super().__init__(options)
        # (monotonic time, step) of the last progress, written by the training thread in one
        # assignment and read whole by the watchdog's; step None: the first step has not completed.
        self.progress: tuple[float, int | None] = (time.monotonic(), None)
        self.final_phase = False  # past the last optimizer step: startup_timeout_s applies again
        self.hangs = 0  # times the limit passed without progress (more than one only with "wait")
        self._max_steps: int | None = None
        self._control = None
        self._run_thread: int | None = None  # ident of the thread that runs the training
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # run end vs. acting on a hang: never fail a run that has ended

    @hookimpl
    def lmlab_run_start(self, control):
        self._control = control
        self._run_thread = threading.get_ident()
        self._max_steps = control.run.train.max_steps
        self.progress = (time.monotonic(), None)
        self.final_phase, self.hangs = False, 0
        self._stopped.clear()
        self._thread = threading.Thread(target=self._watch, name=f"lmlab-watchdog-{control.rank}", daemon=True)
        self._thread.start()

    @hookimpl(tryfirst=True)  # before other monitors: one that hangs in this hook comes after the step
    def lmlab_train_batch_end(self, step):
        self.progress = (time.monotonic(), step)  # the whole per-step cost
        if step == self._max_steps:
            self.final_phase = True

    @hookimpl
    def lmlab_validation_end(self, step):
        self.progress = (time.monotonic(), step)

    @hookimpl
    def lmlab_checkpoint_saved(self, step):
        self.progress = (time.monotonic(), step)

    @hookimpl
    def lmlab_run_end(self):
        with self._lock:
            self._stopped.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)  # at most one poll plus a stack dump
        return {"watchdog_hangs": self.hangs} if self.hangs else None

    # The watchdog's thread.

    def _watch(self) -> None:
        o = self.options
        poll = min(1.0, o.timeout_s / 4, o.startup_timeout_s / 4)
        reported = 0.0  # when the last report was made ("wait"): the next one needs a full limit more
        while not self._stopped.wait(poll):
            since, step = self.progress
            limit = o.timeout_s if step is not None and not self.final_phase else o.startup_timeout_s
            now = time.monotonic()
            if now - max(since, reported) < limit:
                continue
            frame = self._run_frame()
            with self._lock:
                if self._stopped.is_set():
                    return
                self.hangs += 1
                stacks = self._dump(now - since, step)
                frames = _innermost(frame)
                if o.action == "wait":
                    self._control.note(f"watchdog: {_no_step(now - since, step)}; "
                                       f"{'main thread in ' + frames[0] + '; ' if frames else ''}"
                                       f"every thread's stack in {stacks}")
                    reported = time.monotonic()
                    continue
                self._control.fail(self._diagnosis(now - since, step, limit, frames, stacks))
            self._interrupt_if_stuck(frame, min(GRACE_S, limit))
            return

    def _run_frame(self):
        return sys._current_frames().get(self._run_thread)

    def _dump(self, idle: float, step: int | None) -> Path:
        """Every thread's stack, appended to stacks-<rank>.txt and written to stderr; the file's path."""
        control = self._control
        path = Path(control.run_dir) / f"stacks-{control.rank}.txt"
        header = f"lmlab watchdog: {_no_step(idle, step)}; every thread's stack:\n"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.write("\n")
        except OSError as exc:  # a full or read-only disk must not keep the hang from being reported
            print(f"lmlab watchdog: cannot write {path}: {exc}", file=sys.stderr, flush=True)
        sys.stderr.write(header)
        sys.stderr.flush()
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (captured)
            text = path.read_text().rsplit("===", 1)[-1] if path.is_file() else ""
            sys.stderr.write(text.split("\n", 1)[-1])
        return path

    def _diagnosis(self, idle: float, step: int | None, limit: float, frames: list[str],
                   stacks: Path) -> Diagnosis:
        if step is None:
            where = "before its first step (reading the data or building the model)"
            key, name = "monitor.watchdog.startup_timeout_s", "a slow first preparation of the data"
        elif self.final_phase:
            where = "after its last step (in the closing evaluation)"
            key, name = "monitor.watchdog.startup_timeout_s", "a closing evaluation of a large validation split"
        else:
            where = f"after step {step}"
            key, name = "monitor.watchdog.timeout_s", "steps or evaluations this slow"
        evidence = [_no_step(idle, step), *[f"main thread: {f}" for f in frames],
                    f"every thread's stack: {stacks}"]
        fixes = [Fix("read the main thread's innermost frames: the first lmlab or plugin frame is where it waits"),
                 Fix("a data source, filter or tracker that reads from the network: give it a timeout"),
                 Fix("in a multi-process run, a rank waiting in a collective: compare the ranks' stacks files to "
                     "see which one is behind (NCCL_DEBUG=INFO)"),
                 Fix(f"if it was only slow ({name}), allow more time", key, float(f"{2 * limit:.3g}"))]
        return Diagnosis("hang", f"the run made no progress for {_secs(idle)} s {where}", evidence=evidence,
                         fixes=fixes)

    def _interrupt_if_stuck(self, frame, grace: float) -> None:
        """``fail`` interrupts the main thread only when it runs Python code again; one blocked in a C
        call is woken by a real SIGINT, sent when it is still at the same frame and line after
        ``grace`` seconds (a thread that has moved on is unwinding, and is left alone)."""
        if frame is None or self._run_thread != threading.main_thread().ident:
            return
        line = frame.f_lineno
        if self._stopped.wait(grace):
            return
        with self._lock:
            if self._stopped.is_set():
                return
            now = self._run_frame()
            if now is not frame or now.f_lineno != line or not callable(signal.getsignal(signal.SIGINT)):
                return
            print("lmlab watchdog: the main thread is still blocked; interrupting it with SIGINT",
                  file=sys.stderr, flush=True)
            signal.pthread_kill(self._run_thread, signal.SIGINT)


def _innermost(frame) -> list[str]:
    """The innermost frames of a thread's stack, innermost first, as ``file:line in function``."""
    if frame is None:
        return []
    stack = traceback.extract_stack(frame)
    return [f"{_short(fs.filename)}:{fs.lineno} in {fs.name}" for fs in reversed(stack[-FRAMES:])]


def _short(filename: str) -> str:
    """A path relative to the working directory when under it (the run's own code), else as is."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if rel.startswith("..") else rel


def _no_step(idle: float, step: int | None) -> str:
    return f"no step completed for {_secs(idle)} s" + (" since the run started" if step is None else
                                                        f" since step {step}")


def _secs(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 100 else f"{seconds:.3g}"  # 1800, 612, 2.05
