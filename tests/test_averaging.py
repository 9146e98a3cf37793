"""Weight averaging, the robust methods ema, lawa and lawa-live (quant/averaging.py).

Strategy: each average against its closed form, step by step on a toy layer (the EMA recursion, the mean of the
last k kept checkpoints, lawa-live's k − 1 kept and the current weights), then in the training loop: the saved
model is the closed form over the run's raw history checkpoints, an average of one (β = 0, k = 1) is the plain
run bitwise, and lawa-live ends as lawa bitwise while meeting the Common Loss earlier. Resume with every method:
test_robust_resume.py.
"""

import torch
from safetensors.torch import load_file

from optquant.config import apply_overrides
from optquant.model import LM
from optquant.runs import read_metrics
from optquant.train import train


def _weights(path):
    return load_file(path / "model.safetensors")

def _average(method: str, value: float, every: int = 1, eval_every: int = 1, steps: int = 100):
    from optquant.quant.averaging import WeightAverage

    lin = torch.nn.Linear(3, 2).double()
    return lin, WeightAverage(lin, method, value, every, eval_every, steps)


def _random_steps(lin, n: int):
    """(step, w) for steps 0..n−1, the layer's weight set to a new random w before each is yielded."""
    gen = torch.Generator().manual_seed(0)
    for step in range(n):
        w = torch.randn(2, 3, generator=gen, dtype=torch.float64)
        lin.weight.data.copy_(w)
        yield step, w


def test_ema_is_the_closed_form_recursion():
    lin, avg = _average("ema", 0.7, every=2)
    beta, e = 0.7, None
    assert avg.averaged() is None  # before the first update: nothing to average
    for step, w in _random_steps(lin, 9):
        if avg.due(step):  # after steps 2, 4, 6, 8 (done counts)
            avg.update()
            e = w.clone() if e is None else beta * e + (1 - beta) * w
    assert [avg.due(s) for s in range(4)] == [False, True, False, True]
    torch.testing.assert_close(avg.averaged()[0], e, rtol=1e-12, atol=1e-12)
    with avg.swapped():
        torch.testing.assert_close(lin.weight.data, e, rtol=1e-12, atol=1e-12)
    assert torch.equal(lin.weight.data, w)  # the raw weights are back, bitwise


def test_lawa_is_the_equal_average_of_the_last_k_kept_checkpoints():
    lin, avg = _average("lawa", 3, eval_every=5, steps=23)
    kept = []
    for step, w in _random_steps(lin, 23):
        if avg.due(step):
            avg.update()
            kept.append((step + 1, w.clone()))
    assert [s for s, _ in kept] == [5, 10, 15, 20, 23]  # every eval_every steps and the last one
    torch.testing.assert_close(avg.averaged()[0], torch.stack([w for _, w in kept[-3:]]).mean(0))
    state = avg.state()
    _, again = _average("lawa", 3, eval_every=5, steps=23)
    again.load(state)
    assert all(torch.equal(a, b) for a, b in zip(again.averaged(), avg.averaged(), strict=True))


def test_lawa_live_is_the_last_k_minus_1_kept_checkpoints_and_the_current_weights():
    """Between kept checkpoints the current weights are the newest of the k; at a kept one, lawa's average."""
    lin, avg = _average("lawa-live", 3, eval_every=5, steps=23)
    kept = []
    for step, w in _random_steps(lin, 23):
        avg.step(step)
        if avg.due(step):
            kept.append(w.clone())
        members = kept[-3:] if avg.due(step) else [*kept[-2:], w]
        torch.testing.assert_close(avg.averaged()[0], torch.stack(members).mean(0), rtol=1e-12, atol=1e-12)
        with avg.swapped():
            torch.testing.assert_close(lin.weight.data, torch.stack(members).mean(0), rtol=1e-12, atol=1e-12)
        assert torch.equal(lin.weight.data, w)
    assert len(kept) == 5  # steps 5, 10, 15, 20, 23


def test_lawa_live_meets_the_common_loss_where_it_reaches_it_and_ends_as_lawa(nano_cfg, tmp_path):
    """Same trajectory, same kept and final models as lawa; lawa's average moves only at kept checkpoints
    (every 10 steps here), so it crosses at a regular evaluation, lawa-live's at a fine one before it."""
    cfg = apply_overrides(nano_cfg, ["robust.strength=2"])
    lawa = train(apply_overrides(cfg, ["robust.method=lawa"]), tmp_path / "probe")
    vals = [m["val_loss"] for m in read_metrics(tmp_path / "probe")]
    threshold = (vals[1] + vals[2]) / 2  # lawa's average crosses at step 30
    cl = [f"train.cl_threshold={threshold!r}", "train.cl_eval_every=1", "train.cl_eval_from=20"]
    lawa = train(apply_overrides(cfg, ["robust.method=lawa", *cl]), tmp_path / "lawa")
    live = train(apply_overrides(cfg, ["robust.method=lawa-live", *cl]), tmp_path / "live")
    assert lawa["cl_step"] == 30 and 20 < live["cl_step"] < 30
    assert live["final_val_loss"] == lawa["final_val_loss"] and live["robust"] == "lawa-live:2"
    a, b = _weights(tmp_path / "lawa"), _weights(tmp_path / "live")
    assert all(torch.equal(a[k], b[k]) for k in a)
    fine = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / "live")}
    assert fine[live["cl_step"]] <= threshold < fine[live["cl_step"] - 1]


def test_averaged_runs_save_and_evaluate_the_average(nano_cfg, tmp_path):
    from optquant.checkpoint import load_checkpoint
    from optquant.runs import RunDir

    cfg = apply_overrides(nano_cfg, ["train.keep_history=true"])
    plain = train(cfg, tmp_path / "plain")
    for method in ("ema:0", "lawa:1"):  # β = 0, k = 1: the average is the raw model, bitwise
        name, value = method.split(":")
        same = train(apply_overrides(cfg, [f"robust.method={name}", f"robust.strength={value}"]), tmp_path / name)
        assert same["final_val_loss"] == plain["final_val_loss"] and same["robust"] == method
        a, b = _weights(tmp_path / "plain"), _weights(tmp_path / name)
        assert all(torch.equal(a[k], b[k]) for k in a)
    lawa = train(apply_overrides(cfg, ["robust.method=lawa", "robust.strength=2"]), tmp_path / "lawa2")
    raw = []
    for step in (30, 40):  # the kept checkpoints hold the raw weights
        model = LM(cfg.model)
        load_checkpoint(RunDir(tmp_path / "lawa2").history_checkpoint(step), model)
        raw.append(dict(model.named_parameters()))
    final = _weights(tmp_path / "lawa2")
    for k, v in final.items():
        torch.testing.assert_close(v, (raw[0][k] + raw[1][k]) / 2, rtol=0, atol=0)
    assert lawa["final_val_loss"] != plain["final_val_loss"]
    first = read_metrics(tmp_path / "lawa2")[0]["val_loss"]  # one checkpoint kept at step 10: the raw model
    assert first == read_metrics(tmp_path / "plain")[0]["val_loss"]


def test_an_ema_runs_saved_model_is_the_closed_form_over_its_raw_checkpoints(nano_cfg, tmp_path):
    """In the loop: with the EMA updated every 10 steps (the evaluations), the saved model is e_4 of
    e_1 = w_10, e_t = β e_{t−1} + (1 − β) w_{10t} over the kept raw checkpoints, which are the plain run's
    bitwise (the average leaves the trajectory alone); the first evaluation sees e_1 = w_10, the plain model."""
    from optquant.checkpoint import load_checkpoint
    from optquant.runs import RunDir

    cfg = apply_overrides(nano_cfg, ["train.keep_history=true"])
    train(cfg, tmp_path / "plain")
    beta = 0.6
    train(apply_overrides(cfg, ["robust.method=ema", f"robust.strength={beta}", "robust.every=10"]), tmp_path / "ema")
    e = None
    for step in (10, 20, 30, 40):
        raw, plain = LM(cfg.model), LM(cfg.model)
        load_checkpoint(RunDir(tmp_path / "ema").history_checkpoint(step), raw)
        load_checkpoint(RunDir(tmp_path / "plain").history_checkpoint(step), plain)
        w = dict(raw.named_parameters())
        assert all(torch.equal(v, dict(plain.named_parameters())[k]) for k, v in w.items())
        e = {k: v.detach().clone() for k, v in w.items()} if e is None else {
            k: beta * e[k] + (1 - beta) * w[k].detach() for k in e}
    final = _weights(tmp_path / "ema")
    assert final.keys() <= e.keys()  # the tied head is stored once
    for k, v in final.items():
        torch.testing.assert_close(v, e[k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(final["embed.weight"], dict(raw.named_parameters())["embed.weight"])
    assert read_metrics(tmp_path / "ema")[0] == read_metrics(tmp_path / "plain")[0]
