"""A new optimizer is one file, one registry line and the contract test (optim/__init__.py): SGD with
heavy-ball momentum, written to a file here, registered with one `OPTIMIZERS` entry and nothing else,
passes the contract every built-in optimizer passes (test_optim.check_contract) and works everywhere a
built-in one does: `--set optim.name=sgd` and its own ranges, the record round trip, the planner's state
bytes (exactly those of a real step, as test_cost checks the built-ins), its declared param groups (those it
builds, as test_tuning checks the built-ins), the dry run and a training run."""

import importlib.util
import sys
import textwrap

import pytest
from test_cost import measured_state  # the state bytes of a really built optimizer after one step
from test_optim import check_contract
from test_tuning import built_step_sizes  # the param groups of the really built optimizers

import optquant.optim
from optquant.cli import main
from optquant.config import apply_overrides, from_dict, run_id, run_preset, to_dict
from optquant.cost import run_cost
from optquant.errors import OptquantError
from optquant.study.tuning import step_sizes
from optquant.train import train

SGD_FILE = '''
    """SGD with heavy-ball momentum (torch.optim.SGD) on every parameter group."""

    import math
    from dataclasses import dataclass
    from typing import Literal

    import torch

    from optquant.optim.groups import LRGroup, ParamGroups
    from optquant.ranges import NonNegative, Positive, Unit


    @dataclass(frozen=True)
    class SGDConfig:
        name: Literal["sgd"] = "sgd"
        lr: Positive = 0.3
        momentum: Unit = 0.9
        weight_decay: NonNegative = 0.0

        def state_bytes(self, shape: tuple[int, ...], element_size: int, group: str) -> int:
            """torch.optim.SGD's `momentum_buffer`, like the parameter, when momentum > 0."""
            return math.prod(shape) * element_size if self.momentum > 0 else 0

        def lr_groups(self) -> list[LRGroup]:
            return [LRGroup((kind,), self.lr) for kind in ("embeddings", "vectors", "matrices")]

        def build(self, groups: ParamGroups) -> list[torch.optim.Optimizer]:
            params = [{"params": g} for g in (groups.embeddings, groups.vectors, groups.matrices) if g]
            return [torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)]
'''


@pytest.fixture
def sgd(tmp_path, monkeypatch):
    """The SGD file imported as a module, and its one registry line."""
    path = tmp_path / "sgd.py"
    path.write_text(textwrap.dedent(SGD_FILE))
    spec = importlib.util.spec_from_file_location("optquant_test_sgd", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(optquant.optim.OPTIMIZERS, "sgd", module.SGDConfig)  # the one registry line
    return module.SGDConfig


def test_new_optimizer_meets_the_contract(sgd):
    check_contract(sgd())


def test_new_optimizer_in_configs_and_its_ranges(sgd):
    cfg = apply_overrides(run_preset("femto"), ["optim.name=sgd", "optim.momentum=0.5"])
    assert type(cfg.optim) is sgd and cfg.optim.momentum == 0.5
    assert from_dict(to_dict(cfg)) == cfg and run_id(cfg).startswith("femto-sgd-")
    for override, message in [("optim.momentum=1", "optim.momentum=1.0: Expected `float` < 1.0"),
                              ("optim.weight_decay=-1", "optim.weight_decay=-1.0: Expected `float` >= 0.0"),
                              ("optim.lr=0", "optim.lr=0.0: Expected `float` > 0.0")]:
        with pytest.raises(OptquantError) as err:
            apply_overrides(cfg, [override])
        assert str(err.value) == message


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_new_optimizer_state_in_the_planner_is_a_real_steps(sgd, momentum):
    cfg = apply_overrides(run_preset("femto"), ["optim.name=sgd", "model.vocab_size=512",
                                                f"optim.momentum={momentum}"])
    assert run_cost(cfg).state == measured_state(cfg)
    assert step_sizes(cfg, set()) == built_step_sizes(cfg, set())  # its declared param groups are the built ones


def test_new_optimizer_dry_runs_and_trains(sgd, nano_cfg, tmp_path, capsys):
    assert main(["train", "--preset", "nano", "--dry-run", "--set", "optim.name=sgd"]) == 0
    assert "run nano (sgd, lr 0.3)" in capsys.readouterr().out
    cfg = apply_overrides(nano_cfg, ["optim.name=sgd", "train.steps=2", "train.eval_every=2"])
    summary = train(cfg, tmp_path / "run")
    assert summary["steps"] == 2 and summary["optimizer_state_bytes"] == run_cost(cfg).state
