"""Weight averaging, the robust methods `ema` and `lawa`: what the run evaluates and saves is an average.

arXiv 2510.06213 finds PTQ error jumps when the LR decays and that averaging checkpoints helps; in the
openai/parameter-golf competition (issue #238) checkpoint averaging made the quantization gap negative.
Both methods average the parameters only (the buffers here are RoPE caches) and leave the optimizer's
trajectory alone: the raw weights train on, the average is a second copy.

ema (strength β in [0, 1)): torch.optim.swa_utils.AveragedModel with get_ema_multi_avg_fn(β), updated
after every `every`-th optimizer step: e_1 = w_1, e_t = β e_{t−1} + (1 − β) w_t.
lawa (strength k ≥ 1): the equal average of the last k kept checkpoints, the weights at each regular
evaluation (every train.eval_every steps and the last step), as LAWA averages the last k saved
checkpoints (Kaddour 2022, arXiv 2209.14981; Sanyal et al. 2023, arXiv 2306.03241).
lawa-live (strength k): lawa with the current weights always the newest of the k, so the average moves
with every step: the last k − 1 kept checkpoints and the current weights between two kept ones, the last k
kept at a kept one. Its kept and final models are lawa's; what differs is where the average meets the
Common Loss: lawa's average moves only at kept checkpoints, so it crosses the threshold late and below it,
lawa-live's moves with every step and is caught by the fine evaluations, except that one step after each kept
checkpoint its oldest one leaves at once, a jump that grows with k (docs/robust-arm.md: k = 2 crossed at the
plain runs' FP loss, k = 4 below it).

What the run's evaluations see (the validation loss, so the Common-Loss crossing), its CL weights and its
final weights are the average (`swapped`), so PTQ, outliers and ABC measure the averaged model and its FP
loss is the run's val loss; before the first update there is no average and the raw weights stand. The
resumable checkpoint keeps the raw weights with the average's state (`state`/`load`: tensors, stored in
the same safetensors file), so a resumed run is bitwise the straight one. Cost: one parameter copy per
update (k copies of the model in memory for lawa).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class WeightAverage:
    def __init__(self, model: nn.Module, method: str, value: float, every: int, eval_every: int, steps: int):
        self.model, self.method, self.every, self.eval_every, self.steps = model, method, every, eval_every, steps
        self.params = list(model.parameters())
        if method == "ema":
            self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(value), use_buffers=False)
            self.ema.requires_grad_(False)
        else:
            self.k, self.snaps, self.live = int(value), [], method == "lawa-live"
        self.kept_now = True  # the weights are the last update's (lawa-live counts them only once they move on)

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (0-based) ends with an update."""
        done = step + 1
        if self.method == "ema":
            return done % self.every == 0
        return done % self.eval_every == 0 or done == self.steps

    def step(self, step: int) -> None:
        """After optimizer step `step`: update the average if it is due (else the weights have moved on)."""
        if self.due(step):
            self.update()
        else:
            self.kept_now = False

    @torch.no_grad()
    def update(self) -> None:
        self.kept_now = True
        if self.method == "ema":
            self.ema.update_parameters(self.model)
            return
        self.snaps = [*self.snaps, [p.detach().clone() for p in self.params]][-self.k:]

    @torch.no_grad()
    def averaged(self) -> list[torch.Tensor] | None:
        """The average, one tensor per parameter; None before the first update."""
        if self.method == "ema":
            return None if int(self.ema.n_averaged) == 0 else [p.detach() for p in self.ema.module.parameters()]
        live = self.live and not self.kept_now  # the current weights as the newest of the k
        snaps = [*self.snaps, [p.detach() for p in self.params]][-self.k:] if live else self.snaps
        if not snaps:
            return None
        return [sum(ts[1:], ts[0].clone()) / len(ts) for ts in zip(*snaps, strict=True)]

    @contextmanager
    def swapped(self):
        """Inside the block the model's Parameters hold the average (restored bitwise on exit)."""
        avg = self.averaged()
        if avg is None:
            yield
            return
        raw = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, a in zip(self.params, avg, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, r in zip(self.params, raw, strict=True):
                    p.copy_(r)

    def state(self) -> dict[str, Any]:
        if self.method == "ema":
            return {"n": int(self.ema.n_averaged), "avg": [p.detach() for p in self.ema.module.parameters()]}
        return {"snaps": self.snaps}

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        if self.method == "ema":
            for p, t in zip(self.ema.module.parameters(), state["avg"], strict=True):
                p.copy_(t)
            self.ema.n_averaged.fill_(state["n"])
            return
        device = self.params[0].device
        self.snaps = [[t.to(device) for t in snap] for snap in state["snaps"]]
