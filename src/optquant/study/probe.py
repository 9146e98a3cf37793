"""A few-second measurement of this machine's speed on the study's own shapes, before its first job.

For the smallest and the largest size of the study and each optimizer: `STEPS` timed training steps (after one
untimed step, which builds the optimizer's state) of the run's model, optimizer, micro-batch and precision on
random tokens, and one evaluation forward pass per size, in this process with a worker's thread count.
run_study records it in study.json ("probe"); the ETA (study/eta.py `probe_scale`) scales its prior by the
median ratio of probed to prior step times, so its first estimate is this machine's, before any job has
finished. A replay of a recording uses the probe of the machine that recorded it; a study.json without one
keeps the prior.
"""

from __future__ import annotations

import os
import time
from typing import Any

from optquant.study_spec import StudySpec, run_config

STEPS = 5  # timed steps per (optimizer, size); the fastest is the probe's (the least interrupted by other work)


def probe(spec: StudySpec, threads: int) -> dict[str, Any]:
    """{"step": {optimizer: {size: seconds per training step}}, "forward": {size: seconds per eval forward},
    "threads", "load" (the 1-minute load average when measured), "seconds" (what the probe took)}."""
    import torch

    from optquant.device import use_bf16
    from optquant.model import lm_loss
    from optquant.optim import build_optimizers
    from optquant.train import autocast, build_model

    t0, before = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(threads)
    cpu, step, forward = torch.device("cpu"), {}, {}
    try:
        for size in dict.fromkeys((spec.sizes[0], spec.sizes[-1])):
            for opt in spec.optimizers:
                cfg = run_config(spec, size, opt)
                model, bf16 = build_model(cfg), use_bf16(cfg.train.precision, cpu)
                optimizers = build_optimizers(model, cfg.optim)
                micro = cfg.train.batch_size // cfg.train.grad_accum
                x, y = (torch.randint(cfg.model.vocab_size, (micro, cfg.model.seq_len)) for _ in "xy")
                times = []
                for _ in range(STEPS + 1):
                    t = time.perf_counter()
                    for _ in range(cfg.train.grad_accum):
                        with autocast(cpu, bf16):
                            loss = lm_loss(model, x, y)
                        loss.backward()
                    for o in optimizers:
                        o.step()
                        o.zero_grad(set_to_none=True)
                    times.append(time.perf_counter() - t)
                step.setdefault(opt, {})[size] = min(times[1:])
                if size not in forward:
                    with torch.no_grad(), autocast(cpu, bf16):
                        t = time.perf_counter()
                        model(x)
                        forward[size] = time.perf_counter() - t
    finally:
        torch.set_num_threads(before)
    return {"step": step, "forward": forward, "threads": threads, "load": os.getloadavg()[0],
            "seconds": time.perf_counter() - t0}
