"""SIGTERM, the way schedulers preempt a job, handled like Ctrl-C but ending at a safe point.

Outside training, SIGTERM raises :class:`Terminated` (as SIGINT raises ``KeyboardInterrupt``): the
command unwinds, records the run as interrupted and exits with 143 (128 + 15), so ``lmlab run ... &&
next-step`` does not go on and the scheduler can requeue the job. During training a SIGTERM is only
noted (:func:`defer`): the recorder ends the run at the next optimizer step, after writing a
checkpoint there, so the requeued run resumes exactly where this one stopped.
"""

import signal
import threading

EXIT_STATUS = 143


class Terminated(BaseException):
    """The process received SIGTERM. A BaseException, like KeyboardInterrupt: ``except Exception``
    clauses that record a failure must not catch it."""


_received = False


def install() -> None:
    """SIGTERM raises :class:`Terminated` from now on (main thread only: Python delivers signals there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def defer() -> None:
    """From now on SIGTERM is only noted (:func:`received`); the training loop stops at a step's end.

    Called once training has started, after Lightning registered its own handler, which would
    otherwise stop the loop in the middle of an accumulation and without a checkpoint."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _note)


def received() -> bool:
    return _received


def _raise(signum, frame) -> None:
    global _received
    _received = True
    raise Terminated()


def _note(signum, frame) -> None:
    global _received
    _received = True
