"""One process's pipeline stage: the torch.distributed.pipelining schedules around it, the loss
weighting of micro-batches, and the gradient sum of parameters that several stages hold."""

import torch
import torch.distributed as dist

from lmlab.api import IGNORE_INDEX, Batch

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


class Stage:
    """Stage ``index`` of ``stages`` over process group ``group``, running ``model`` (already split)."""

    def __init__(self, model, index: int, stages: int, group, n_microbatches: int, schedule: str,
                 pipelines: list[list[int]] | None = None):
        self.model, self.index, self.stages, self.group = model, index, stages, group
        self.n_microbatches, self.schedule = n_microbatches, schedule
        self.ranks = dist.get_process_group_ranks(group)  # global rank of each stage
        # The global ranks of every pipeline in the run (one per data- and tensor-parallel index):
        # creating a process group is collective over the world, so each rank creates them all.
        self.pipelines = pipelines or [self.ranks]
        self._schedules: dict = {}
        self._step: dict = {}  # what the loss function needs during one schedule step
        self.shared = self._shared_parameters()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _shared_parameters(self) -> list[tuple[tuple[int, ...], object, list[str]]]:
        """(holding stages, their process group, parameter names) for each set of stages that hold
        the same parameters: the tied embedding (first and last), the position module's (all)."""
        names = [name for name, _ in self.model.named_parameters()]
        everyone: list = [None] * self.stages
        dist.all_gather_object(everyone, names, group=self.group)
        holders: dict[str, tuple[int, ...]] = {}
        for stage, stage_names in enumerate(everyone):
            for name in stage_names:
                holders[name] = holders.get(name, ()) + (stage,)
        by_set: dict[tuple[int, ...], list[str]] = {}
        for name, stages in holders.items():
            if len(stages) > 1:
                by_set.setdefault(stages, []).append(name)
        self.owner = {name: stages[0] for name, stages in holders.items()}
        shared = []
        for stages in sorted(by_set):  # the same order everywhere: new_group is collective
            group = self.group
            if len(stages) < self.stages:
                for ranks in self.pipelines:
                    created = dist.new_group([ranks[s] for s in stages])
                    if ranks == self.ranks:
                        group = created
            if self.index in stages:
                shared.append((stages, group, sorted(by_set[stages])))
        return shared

    def owned_grads(self) -> list[torch.Tensor]:
        """This stage's gradients, a shared parameter's only on the first stage that holds it."""
        return [p.grad for name, p in self.model.named_parameters()
                if p.grad is not None and self.owner[name] == self.index]

    def run(self, batch: Batch, loss_fn, grad_scale: float, train: bool) -> torch.Tensor:
        """Forward (and, in training, backward) of ``batch`` through the pipeline; the batch's loss,
        the same in every process."""
        B, T = batch.input_ids.shape
        m = self.n_microbatches if train else max(d for d in range(1, self.n_microbatches + 1) if B % d == 0)
        schedule = self._schedule(B, T, m, train)
        # Each micro-batch's loss is the objective's mean over its counted targets; weighted by its
        # share of the batch's counted targets, their sum is the loss of the whole batch.
        counts = (batch.targets != IGNORE_INDEX).reshape(m, -1).sum(dim=1).tolist()  # one host sync
        self._step = {"loss_fn": loss_fn, "total": max(sum(counts), 1), "scale": grad_scale,
                      "all_counted": min(counts) > 0}
        packed = torch.stack([batch.input_ids, batch.targets], dim=-1)  # (B, T, 2): split with the inputs
        losses: list = []
        before = self._shared_grads() if train else None
        if train:
            schedule.step(batch.input_ids, target=packed, losses=losses, return_outputs=False)
            self._sum_shared_grads(before)
        else:
            schedule.eval(batch.input_ids, target=packed, losses=losses, return_outputs=False)
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).sum() / grad_scale
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.ranks[-1], group=self.group)  # only the last stage computed it
        return loss

    def _loss(self, logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        # Called on the last stage for each micro-batch (and once more while the schedule infers
        # shapes on its first step; that call's gradients reach no parameter).
        step = self._step
        targets = packed[..., 1]
        count = (targets != IGNORE_INDEX).sum()
        if not step["all_counted"] and int(count) == 0:  # all ignored: the objective's mean is 0/0
            return logits.sum() * 0.0
        loss = step["loss_fn"](logits, Batch(packed[..., 0], targets))
        return loss * (count / step["total"] * step["scale"])

    def _schedule(self, B: int, T: int, m: int, train: bool):
        # One stage object per shape: its receive buffers are sized from the first micro-batch.
        key = (B, T, m, train)
        if key not in self._schedules:
            from torch.distributed import pipelining

            stage = pipelining.PipelineStage(self.model, self.index, self.stages, self.device, group=self.group)
            kind = getattr(pipelining, SCHEDULES[self.schedule] if train else "ScheduleGPipe")
            # scale_grads=False: _loss already weights each micro-batch, and the schedule's own
            # scaling would divide the gradients accumulated over earlier micro-steps as well.
            self._schedules[key] = kind(stage, n_microbatches=m, loss_fn=self._loss, scale_grads=False)
        return self._schedules[key]

    def _shared_grads(self) -> list[list[torch.Tensor | None]]:
        params = dict(self.model.named_parameters())
        return [[None if params[n].grad is None else _local(params[n].grad).clone() for n in names]
                for _, _, names in self.shared]

    def _sum_shared_grads(self, before: list[list[torch.Tensor | None]]) -> None:
        """Add up, over the stages holding it, what this backward pass contributed to each shared
        parameter's gradient (a stage that did not use it contributes zero), so all copies agree.
        Sharded (DTensor) copies are summed shard by shard: the stages shard them alike."""
        params = dict(self.model.named_parameters())
        for (_, group, names), previous in zip(self.shared, before):
            ps = [params[n] for n in names]
            dtype = ps[0].dtype
            parts = [(_local(p.grad) - prev if prev is not None else _local(p.grad)) if p.grad is not None
                     else torch.zeros_like(_local(p)) for p, prev in zip(ps, previous)]
            flags = torch.tensor([float(p.grad is not None) for p in ps], dtype=dtype, device=parts[0].device)
            flat = torch.cat([x.reshape(-1).to(dtype) for x in parts] + [flags])
            dist.all_reduce(flat, group=group)
            offset = 0
            for p, part_of, prev, flag in zip(ps, parts, previous, flat[-len(ps):].tolist()):
                part = flat[offset:offset + part_of.numel()].view_as(part_of)
                offset += part_of.numel()
                if not flag:
                    continue
                total = part if prev is None else prev + part  # some stage computed it: every copy gets the sum
                if p.grad is not None:
                    _local(p.grad).copy_(total)
                else:
                    p.grad = _like(p, total.clone())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``param``: a DTensor placed as it is, when it is one."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local
