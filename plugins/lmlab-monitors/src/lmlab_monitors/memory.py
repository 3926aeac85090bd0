"""Peak host and device memory of each logging window, and a warning before memory runs out.

The host: the process's peak resident set size (``VmHWM`` in ``/proc/self/status``), reset after
each reading by writing ``5`` to ``/proc/self/clear_refs`` (Linux 4.0 and later, see proc(5)), so
each logging step reports the peak of the steps since the previous one, however briefly it was
reached. Where either file is missing (not Linux, a locked-down container), the resident set size
at the logging step (psutil) stands in: a sample, not a peak.

The device (CUDA runs only): ``torch.cuda.max_memory_allocated`` since the previous logging step,
the memory the tensors held at their peak, reset with ``torch.cuda.reset_peak_memory_stats``. The
warning judges ``max_memory_reserved`` instead, what the caching allocator held: that is what runs
into the device's capacity first.

All of it is read on logging steps only, in MiB (2^20 bytes), as the core's ``peak_mem_mb``.
"""

import torch

from lmlab.api import Field, Monitor, Options, hookimpl

MIB = 2 ** 20


class MemoryOptions(Options):
    warn_fraction: float = Field(0.9, gt=0, le=1, help="warn once when a window's peak passes this share of "
                                                       "the device's memory (the GPU's, or the host's RAM on "
                                                       "the CPU)")


def read_peak_rss() -> tuple[float, bool]:
    """The process's peak resident set since the last reset in MiB, and whether it is a true peak
    (False: the current resident set, where ``/proc/self/status`` cannot be read)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / MIB, True  # kB
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    return psutil.Process().memory_info().rss / MIB, False


def reset_peak_rss() -> bool:
    """Starts a new peak at the current resident set size; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Memory(Monitor):
    """``memory``: logs each window's peak host RSS (and device memory on a GPU); warns near the limit."""

    Options = MemoryOptions
    api = ">=1.7,<2"  # lmlab.api.monitor

    def __init__(self, options=None):
        super().__init__(options)
        self.host_peak: float | None = None  # MiB, the largest window peak so far
        self.device_peak: float | None = None
        self._warned = False
        self._device: torch.device | None = None  # the device of the last logging step

    @hookimpl
    def lmlab_train_batch_end(self, loss, log, control):
        if not log:
            return None
        return self.measure(loss.device if loss is not None else torch.device("cpu"), control)

    def measure(self, device: torch.device, control, reset: bool = True) -> dict:
        """This window's peaks (and starts the next window when ``reset``)."""
        self._device = device
        host, _ = read_peak_rss()
        if reset:
            reset_peak_rss()
        self.host_peak = max(self.host_peak or 0.0, host)
        metrics = {"host_rss_mb": host}
        if device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated(device) / MIB
            reserved = torch.cuda.max_memory_reserved(device) / MIB
            if reset:
                torch.cuda.reset_peak_memory_stats(device)
            self.device_peak = max(self.device_peak or 0.0, allocated)
            metrics["device_mem_mb"] = allocated
            total = torch.cuda.get_device_properties(device).total_memory / MIB
            self._warn(reserved, total, f"GPU {device}", "held by the allocator", control)
        else:
            import psutil

            total = psutil.virtual_memory().total / MIB
            self._warn(host, total, "host", "resident", control)
        return metrics

    def _warn(self, used: float, total: float, where: str, what: str, control) -> None:
        fraction = self.options.warn_fraction
        if self._warned or used < fraction * total:
            return
        self._warned = True
        control.note(f"memory: {used:,.0f} MiB {what} at the peak, {used / total:.0%} of the {where}'s "
                     f"{total:,.0f} MiB (warn_fraction {fraction:g}): close to running out; a smaller "
                     "batch_size with more grad_accum, or activation checkpointing, would leave room")

    @hookimpl
    def lmlab_run_end(self):
        # The last window (after the last logging step) is read too, without a reset: the core reads
        # the same counters for summary.json's peak_mem_mb after this.
        try:
            host, _ = read_peak_rss()
            self.host_peak = max(self.host_peak or 0.0, host)
            device = self._device
            if device is not None and device.type == "cuda":
                self.device_peak = max(self.device_peak or 0.0, torch.cuda.max_memory_allocated(device) / MIB)
        except Exception:  # noqa: BLE001 - a broken device must not cost the summary the peaks seen
            pass
        summary = {}
        if self.host_peak is not None:
            summary["host_rss_peak_mb"] = self.host_peak
        if self.device_peak is not None:
            summary["device_mem_peak_mb"] = self.device_peak
        return summary
