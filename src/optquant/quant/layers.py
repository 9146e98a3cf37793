"""The linear layers quantization works on: `QuantLinear` (PTQ's fake-quantized layer), and the two
helpers PTQ, QAT and the metrics share: `linear_layers(model, skip)` chooses the layers,
`replace_module(model, name, new)` swaps one, `model_name(name)` names one as the model does. Below ptq.py and
qat.py, so the metrics need neither.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from optquant.errors import OptquantError
from optquant.quant.primitives import QuantSpec, fake_quant


class QuantLinear(nn.Module):
    """A linear layer with a fake-quantized weight and dynamically fake-quantized inputs.

    `weight` is the dequantized Ŵ (a frozen Parameter, so state_dict keys match nn.Linear);
    forward(x) = F.linear(fake_quant(x, act), Ŵ, bias), with act = None meaning inputs stay as they are.
    """

    def __init__(
        self, weight: Tensor, bias: Tensor | None = None, act: QuantSpec | None = None, scheme: str = ""
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.act = act
        self.scheme = scheme

    def forward(self, x: Tensor) -> Tensor:
        if self.act is not None:
            x = fake_quant(x, self.act)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.scheme or 'fp'}")


def linear_layers(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every nn.Linear or QuantLinear, in registration order, except those whose
    name is, or ends with "." + , an entry of `skip`. For optquant models registration order is forward
    order (llama's up_proj is listed before gate_proj; both read the same input)."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear | QuantLinear) and not any(n == s or n.endswith("." + s) for s in skip)]


def model_name(name: str) -> str:
    """A linear's name as the model has it: the linear inside a rotation's wrapper (quant/rotate.py's `Rotated`
    before o_proj and down_proj, which holds it as `.linear`) goes by the wrapper's name. A bit plan names
    modules so (`PTQConfig.plan`), whatever the scheme's rotation."""
    return name.removesuffix(".linear")


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put `new` at dotted path `name` inside `model` (PTQ and QAT swap layers with this); returns it."""
    if not name:
        raise OptquantError("quantize_ needs a model that contains linear layers, not a bare nn.Linear")
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
    return new
