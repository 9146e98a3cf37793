"""Data parallelism for one run across processes or GPUs (torchrun + DDP; gloo on CPU, NCCL on GPU).

Second-order optimizers (Shampoo, SOAP, PSGD, Muon) need whole matrices, so parameters are replicated
(DDP) rather than sharded. Every rank draws its own micro-batches (its own data generator seed); the
global batch is `train.batch_size` sequences summed over ranks and accumulation steps. A single process
(no WORLD_SIZE) gets a trivial context, so the training loop has one code path.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

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
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

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


def setup() -> Context:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Context(0, 1, device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not tdist.is_initialized():
        tdist.init_process_group(backend)
    return Context(rank, world, device)


def teardown(ctx: Context) -> None:
    if ctx.world_size > 1 and tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
