"""One process, one device.

The baseline layout: the whole model, optimizer state and batch live on one device and no
collective communication happens. ``accelerator = "auto"`` picks CUDA, then Apple MPS, then the CPU;
``device`` chooses which of several GPUs (``CUDA_VISIBLE_DEVICES`` numbering).
"""

from typing import Any, Literal

import torch

from lmlab.api import Field, Options, Parallel, UserError


class SingleDeviceOptions(Options):
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps"] = Field(
        "auto", help="device type; auto = cuda if available, else mps, else cpu")
    device: int = Field(0, ge=0, help="index of the device to use (ignored on cpu)")


class SingleDevice(Parallel):
    """Train in this process on one device (Lightning's single-device strategy)."""

    Options = SingleDeviceOptions
    api = ">=1.6,<2"  # Parallel.device_type

    def trainer_kwargs(self) -> dict[str, Any]:
        accelerator = self.device_type()  # the "auto" rule of lmlab.api.resolve_devices
        if accelerator == "cpu":
            # Lightning reads an int for the CPU as a number of processes, not an index.
            return {"strategy": "auto", "accelerator": "cpu", "devices": 1, "num_nodes": 1}
        count = torch.cuda.device_count() if accelerator == "cuda" else 1
        if self.options.device >= count:
            raise UserError(f"device {self.options.device} does not exist: this machine has {count} "
                            f"{accelerator} device(s), numbered from 0", key="parallel.device")
        return {"strategy": "auto", "accelerator": accelerator, "devices": [self.options.device],
                "num_nodes": 1}

    def memory_layout(self, model, world_size: int | None, precision: str):
        """Everything on the one device; nothing to communicate."""
        from lmlab.api.layout import MemoryLayout  # API 1.4; imported here so older cores still load the plugin

        return MemoryLayout(devices=1)

