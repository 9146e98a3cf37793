"""Record what chosen modules see and produce during a forward pass, via forward hooks.

`with capture(model, modules) as acts:` registers one forward hook per module and removes every hook
on exit, also when the forward raises. Each call of a module appends its first input (and, with
`outputs=True`, its output) to `acts.inputs[name]` / `acts.outputs[name]`, detached. For statistics
over many batches pass `fn(name, input, output)` instead: it is called on every forward and nothing is
stored, so memory stays flat (the outlier metrics stream this way).

Left out on purpose: keyword-only inputs other than the first, backward hooks, and gradient capture;
the metrics need none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor, nn

from optquant.errors import OptquantError

OnForward = Callable[[str, Tensor, Tensor | None], None]


@dataclass
class Activations:
    """Per-module lists of tensors, one entry per forward call, in call order."""

    inputs: dict[str, list[Tensor]] = field(default_factory=dict)
    outputs: dict[str, list[Tensor]] = field(default_factory=dict)


def _named(model: nn.Module, modules) -> list[tuple[str, nn.Module]]:
    """Accept a name->module mapping, (name, module) pairs, or bare modules of `model`."""
    if isinstance(modules, Mapping):
        return list(modules.items())
    items = list(modules)
    if all(isinstance(m, tuple) and len(m) == 2 for m in items):
        return [(str(n), m) for n, m in items]
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for m in items:
        if not isinstance(m, nn.Module) or id(m) not in names:
            raise OptquantError(f"capture: {type(m).__name__} is not a submodule of the model")
        out.append((names[id(m)], m))
    return out


def _first_input(args: tuple, kwargs: dict) -> Tensor:
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    raise OptquantError("capture: a hooked module was called without inputs")


@contextmanager
def capture(
    model: nn.Module,
    modules: Mapping[str, nn.Module] | Iterable[tuple[str, nn.Module]] | Iterable[nn.Module],
    *,
    outputs: bool = False,
    fn: OnForward | None = None,
) -> Iterator[Activations]:
    """Hook `modules` of `model` for the `with` block (module docstring); with `fn` the Activations stay empty."""
    acts = Activations()
    handles = []

    def make_hook(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            x = _first_input(args, kwargs).detach()
            y = output.detach() if outputs and isinstance(output, Tensor) else None
            if fn is not None:
                fn(name, x, y)
                return
            acts.inputs.setdefault(name, []).append(x)
            if y is not None:
                acts.outputs.setdefault(name, []).append(y)

        return hook

    try:
        for name, module in _named(model, modules):
            handles.append(module.register_forward_hook(make_hook(name), with_kwargs=True))
        yield acts
    finally:
        for h in handles:
            h.remove()
