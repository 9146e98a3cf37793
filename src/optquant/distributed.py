"""Data parallelism for one run across processes or GPUs (torchrun + DDP; gloo on CPU, NCCL on GPU).

Second-order optimizers (Shampoo, SOAP, PSGD, Muon) need whole matrices, so parameters are replicated
(DDP) rather than sharded. Every rank draws its own micro-batches (its own data generator seed); the
global batch is `train.batch_size` sequences summed over ranks and accumulation steps. A single process
(no WORLD_SIZE) gets a trivial context, so the training loop has one code path. Left out on purpose:
FSDP/ZeRO sharding (the optimizers above need whole matrices) and multi-node launch helpers (torchrun
does that).
"""

from __future__ import annotations

import atexit
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    device: torch.device

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        # Buffers are constants (RoPE tables, Hadamard matrices) or set identically on every rank (the
        # QAT LSQ `initialized` flag after an all-reduced init): re-broadcasting them before every
        # forward, DDP's default, only costs time (14 MB per micro-batch for the 1.5B preset's RoPE).
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)

    def no_sync(self, model: nn.Module, last: bool):
        """Skip the gradient all-reduce on all but the last accumulation micro-step."""
        if self.world_size == 1 or last:
            return nullcontext()
        return model.no_sync()

    def mean(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return t.item() / self.world_size

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank; a collective call."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            tdist.barrier()


def setup() -> Context:
    """The process's rank and device; joins the process group under torchrun (WORLD_SIZE > 1).

    Ends with a barrier, so whatever a rank did to the run directory before training (the CLI's
    `--force` removal) is finished before any rank looks for a checkpoint in it.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Context(0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not tdist.is_initialized():
        tdist.init_process_group(backend)
        atexit.register(_destroy)
    ctx = Context(rank, world, device)
    ctx.barrier()
    return ctx


def teardown(ctx: Context) -> None:
    """End a run in step on every rank. The process group stays up for the process's next run: torch
    2.13 re-initialising a destroyed group under torchrun intermittently hangs or fails to connect
    (gloo meets the previous group's addresses in the agent's store): 2 of 6 launches that re-created
    the group 4 times failed here. The group is destroyed at process exit instead."""
    ctx.barrier()


def _destroy() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()
