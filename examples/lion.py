"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675, Algorithm 2)
as an optquant optimizer plugin:  optquant train --set optim.name=examples/lion.py:make_optimizer

    c = β1·m + (1 − β1)·g;   θ ← θ − lr·(sign(c) + λ·θ);   m ← β2·m + (1 − β2)·g
"""

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in (p for p in group["params"] if p.grad is not None):
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = (beta1 * m + (1 - beta1) * p.grad).sign_()
                p.add_(update + wd * p, alpha=-lr)
                m.lerp_(p.grad, 1 - beta2)


def make_optimizer(groups, lr):
    """One Lion over the paper's three groups; weight decay on the hidden matrices only."""
    param_groups = [{"params": groups.embeddings}, {"params": groups.vectors},
                    {"params": groups.matrices, "weight_decay": 0.1}]
    return Lion([g for g in param_groups if g["params"]], lr=lr)


make_optimizer.default_lr = 3e-4  # the paper: 3-10x below AdamW's lr (ours: 3e-3), with 3-10x the decay
