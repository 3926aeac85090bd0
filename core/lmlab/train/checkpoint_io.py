"""How a checkpoint reaches the disk: straight into the run folder, durably.

Lightning's own writer serialises the whole checkpoint into memory, then copies it through an fsspec
transaction staged in ``$TMPDIR``: twice the checkpoint's size in memory, and a checkpoint-sized
orphan in ``/tmp`` when the process is killed mid-save (or a failed save when ``/tmp`` is small).
The recorder already writes under a temporary name inside the run folder and renames the finished
file into place, so here torch writes to that name directly and the data is flushed to the disk
before the rename. Strategies that write a single file from rank 0 (single device, DDP, FSDP and
model parallelism with full state dicts, DeepSpeed's weights file) go through this.
"""

import os
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class RunFolderCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())


def replace(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` over ``path`` and make the rename itself durable."""
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
