"""The cores this process may run on: its CPU affinity (taskset, a SLURM cpuset, a container's
cpuset), not the machine's count, so the threads handed to children never outnumber them."""

import os


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
