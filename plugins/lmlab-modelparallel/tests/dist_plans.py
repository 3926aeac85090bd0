"""Run by test_plans.py as ``python dist_plans.py OUT.json``: two gloo processes apply each attention
and ffn plugin's tensor-parallel plan over a 2-rank mesh and compare with the unsharded module:
outputs, input gradients, the state dict after one SGD step (so every parameter's gradient, through
the fused projection's permutation) and loading a single-device state dict. Rank 0 writes the
largest differences as JSON. A script rather than a test module: spawned processes must import
their target by name, which pytest's importlib mode does not allow."""

import copy
import json
import os
import socket
import sys
from importlib.metadata import entry_points

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmlab.api import MixerContext, ModelShape

CASES = [  # (slot, plugin, options, position scheme)
    ("attention", "mha", {}, "rope"),
    ("attention", "mha", {}, "alibi"),
    ("attention", "gqa", {"n_kv_heads": 2}, "rope"),
    ("attention", "gqa", {"n_kv_heads": 2}, "alibi"),
    ("ffn", "mlp", {}, None),
    ("ffn", "swiglu", {"hidden": 48}, None),
]


def plugin(slot: str, name: str, **options):
    cls = next(iter(entry_points(group=f"lmlab.{slot}", name=name))).load()
    return cls(cls.Options(**options))


def compare(world: int, rank: int, mesh, slot, name, options, scheme) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor.parallel import parallelize_module

    shape = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=11, bias=True)
    torch.manual_seed(0)  # the same weights and inputs in every process
    reference = plugin(slot, name, **options).build(shape, 0)
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0, 0.3)  # biases too, so a misplaced bias row shows
    pristine = copy.deepcopy(reference.state_dict())
    sharded = copy.deepcopy(reference)
    parallelize_module(sharded, mesh, sharded.tensor_parallel_plan(world))
    x = torch.randn(2, shape.block_size, shape.d_model)
    weight = torch.randn(2, shape.block_size, shape.d_model)  # so each output element gets its own gradient
    args = ()
    if slot == "attention":
        position = plugin("position", scheme).build(shape)
        args = (MixerContext(position, torch.arange(shape.block_size)),)
    results = {}
    outputs = []
    for module in (reference, sharded):
        xi = x.clone().requires_grad_()
        y = module(xi, *args)
        (y * weight).sum().backward()
        outputs.append((y.detach(), xi.grad))
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad  # one SGD step: the state dicts then compare every gradient
    results["output"] = (outputs[0][0] - outputs[1][0]).abs().max().item()
    results["input_grad"] = (outputs[0][1] - outputs[1][1]).abs().max().item()
    expected, got = reference.state_dict(), full(sharded.state_dict())  # collectives in every process
    results["same_names"] = list(expected) == list(got)
    results["after_step"] = max((expected[k] - got[k]).abs().max().item() for k in expected)
    # A single-device state dict loaded into freshly sharded modules gives the original weights back.
    fresh = plugin(slot, name, **options).build(shape, 0)
    parallelize_module(fresh, mesh, fresh.tensor_parallel_plan(world))
    # As Lightning loads a consolidated checkpoint into DTensor modules.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, {k: v.clone() for k, v in pristine.items()}, options=options)
    reloaded = full(fresh.state_dict())
    results["reloaded"] = max((pristine[k] - reloaded[k]).abs().max().item() for k in pristine)
    return results


def full(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        report = {f"{slot}:{name}:{scheme}": compare(world, rank, mesh, slot, name, options, scheme)
                  for slot, name, options, scheme in CASES}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(2, free_port(), sys.argv[1]), nprocs=2)
