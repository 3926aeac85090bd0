"""The ``dask`` executor: a sweep's variants, or a preparation's tasks, on a Dask cluster."""

from typing import Callable

from lmlab.api import Executor, Field, JobOutcome, Options, VariantJob


class DaskOptions(Options):
    scheduler: str | None = Field(None, help="a running scheduler's address (tcp://host:8786); default: a local "
                                             "cluster of single-threaded worker processes, stopped at the end")


class Dask(Executor):
    """Each variant a task on a Dask worker, one at a time per worker, in its own process (a crash or an
    out-of-memory kill loses that variant only); a worker lost mid-variant has its task run again
    elsewhere, resuming from the variant's last checkpoint. ``lmlab prepare``'s tasks too."""

    Options = DaskOptions
    api = ">=1.23,<2"  # Executor

    def __init__(self, options=None):
        super().__init__(options)
        self.sweep = None

    def start(self, parallel: int | None, jobs: list[VariantJob]) -> None:
        from lmlab_dask.sweep import Sweep

        self.sweep = Sweep(self.options.scheduler, parallel, jobs)
        self.sweep.start()

    def run_variants(self, jobs: list[VariantJob], parallel: int | None, say: Callable[[str], None],
                     report) -> dict[str, JobOutcome]:
        return self.sweep.run(say, report)

    def preparation(self, workers: int, filters: list, listener, kit):
        from lmlab_dask.preparation import DaskWorkers

        return DaskWorkers(workers, filters, kit, self.options.scheduler, listener)

    def close(self) -> None:
        if self.sweep is not None:
            self.sweep.close()
            self.sweep = None
