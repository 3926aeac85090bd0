"""Two CPU processes, one fully_shard-ed linear layer, torch's plain GradScaler, and an overflow in
one rank's gradient shard only: writes each rank's outcome to OUT_DIR/rank<r>.json. Run by test_fsdp.py
as ``python scaler_worker.py OUT_DIR``."""

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, backoff_factor=0.5)
        outcome = []
        for overflow in (False, True):
            optimizer.zero_grad()
            scaler.scale(model(torch.ones(2, 4)).sum()).backward()
            if overflow and rank == 1:
                with torch.no_grad():
                    model.weight.grad.to_local().fill_(float("inf"))
            before = model.weight.full_tensor().clone()
            scaler.step(optimizer)
            scaler.update()
            outcome.append({"stepped": not torch.equal(before, model.weight.full_tensor()),
                            "scale": scaler.get_scale()})
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(outcome))
        # Without it a loaded machine can let one rank tear gloo down while the other is still
        # reading the last all-gather's tail, and that rank aborts ("terminate called without an
        # active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(worker, args=(2, free_port, sys.argv[1]), nprocs=2)
    sys.exit(0)
