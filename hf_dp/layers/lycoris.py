"""What the rules of peft's LyCORIS adapters on ``nn.Linear`` share (:mod:`.loha`, :mod:`.lokr`): which adapters a
call ran, read off its recorded random draws, and the loop over the adapters.

In training, peft's ``LycorisLayer.forward`` draws ``torch.rand(1)`` for every active adapter and adds the adapter's
output only if the draw exceeds ``module_dropout``: the whole batch keeps or drops the adapter (with
``module_dropout=0`` the draw is still made, and drops the adapter when it is exactly 0). An adapter that runs with
``rank_dropout`` then draws ``torch.rand(out_features)`` and scales row ``o`` of its delta weight by
``d_o = keep_o / mean(keep)`` (LoHa always, LoKr if ``rank_dropout_scale``). The engine records these draws in the
forward pass (``records_random``); the rule reads them, so each call's gradient is that of what the call computed.

A call adds ``y_t = s diag(d) dW x_t`` (``s`` the scaling, ``dW`` the adapter's delta weight). With output gradient
``g_t`` and ``u_t = s d * g_t``, ``dL_i/d(dW) = sum_t u_t x_t^T``, which each rule pushes through its factorisation
without forming that ``out x in`` matrix per example. A parameter of an adapter the call did not run gets a zero
gradient (a recorded use that contributed nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import Captured, LayerRule, NeedsFallback, UnsupportedModuleError, flatten_sequence
from .grads import InstantiatedGrad, PerExampleGrad, promote

__all__ = ["LycorisCall", "LycorisLinearRule"]


@dataclass(frozen=True)
class LycorisCall:
    """What one call ran with: the training flag, and per active adapter (in order; none when the adapters are
    disabled or merged) ``(name, scaling, module_dropout, rank_dropout, rank_dropout_scale)``."""

    training: bool
    adapters: tuple[tuple[str, float, float, float, bool], ...]


class LycorisLinearRule(LayerRule):
    """The shared part of the LoHa and LoKr rules; a subclass names its factors and gives their gradients."""

    records_random = True
    #: The ``ParameterDict`` attributes of the module that hold the adapters' factors.
    factor_names: tuple[str, ...] = ()
    #: Factor attributes the closed form does not cover (CP decompositions of convolutions): the fallback does.
    unsupported: tuple[str, ...] = ()

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        return [p for name in self.factor_names for p in getattr(module, name).values()]

    def check(self, module: nn.Module, name: str) -> None:
        if type(module.get_base_layer()) is not nn.Linear or any(len(getattr(module, n)) for n in self.unsupported):
            raise NeedsFallback(f"`{name}` ({type(module).__name__}) is not a LyCORIS adapter on a plain nn.Linear")

    def capture(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Captured:
        ran = () if module.disable_adapters or module.merged else module.active_adapters
        adapters = tuple(
            (a, module.scaling[a], module.module_dropout[a], module.rank_dropout[a], self._rank_scale(module, a))
            for a in ran
            if a in module._available_adapters
        )
        return Captured(args=(args[0], LycorisCall(module.training, adapters)))

    @staticmethod
    def _rank_scale(module: nn.Module, adapter: str) -> bool:
        return True

    def rank_factors(self, keep: Tensor, scale: bool, dtype: torch.dtype) -> Tensor:
        """The row factors ``d`` of the delta weight from the kept rows, as peft computes them."""
        raise NotImplementedError

    def adapter_grads(
        self, module: nn.Module, adapter: str, x: Tensor, u: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, Tensor]:
        """``[N, *shape]`` gradients of the adapter's trainable factors, for inputs ``x`` ``[N, T, in]`` and
        ``u = s d * g`` ``[N, T, out]``."""
        raise NotImplementedError

    def per_example_grads(
        self, module: nn.Module, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        call: LycorisCall = captured.args[1]
        runs = self._runs(module, call, captured.random)
        g = flatten_sequence(grad_output)
        x = flatten_sequence(captured.args[0])
        grads: dict[nn.Parameter, PerExampleGrad] = {}
        for attr in self.factor_names:
            for adapter, p in getattr(module, attr).items():
                if p in trainable and adapter not in runs:  # not run by this call: nothing to its gradient
                    grads[p] = InstantiatedGrad(torch.zeros(g.shape[0], *p.shape, dtype=p.dtype, device=p.device))
        for adapter, (scaling, rows) in runs.items():
            dtype = promote(promote(g.dtype, x.dtype), promote(self.parameters(module)[0].dtype, torch.float32))
            u = g.to(dtype) * scaling if rows is None else g.to(dtype) * (scaling * rows.to(g.device, dtype))
            for p, value in self.adapter_grads(module, adapter, x.to(dtype), u, trainable).items():
                grads[p] = InstantiatedGrad(value)
        return grads

    def _runs(self, module: nn.Module, call: LycorisCall, draws: list) -> dict[str, tuple[float, Tensor | None]]:
        """``adapter -> (scaling, row factors or None)`` for every adapter the call ran, from its recorded draws."""
        runs: dict[str, tuple[float, Tensor | None]] = {}
        position = 0

        def take(shape: tuple[int, ...]) -> Tensor:
            nonlocal position
            if position >= len(draws) or draws[position][0] != "draw" or tuple(draws[position][1].shape) != shape:
                raise self._mismatch(module, call, draws)
            position += 1
            return draws[position - 1][1]

        for adapter, scaling, module_dropout, rank_dropout, rank_scale in call.adapters:
            if call.training and not bool(take((1,)) > module_dropout):
                continue  # peft: `torch.rand(1) > module_dropout` dropped the adapter for the whole call
            rows = None
            if call.training and rank_dropout:
                keep = take((module.out_features,)) > rank_dropout
                rows = self.rank_factors(keep, rank_scale, self._dtype(module, adapter))
            runs[adapter] = (scaling, rows)
        if position != len(draws):
            raise self._mismatch(module, call, draws)
        return runs

    def _dtype(self, module: nn.Module, adapter: str) -> torch.dtype:
        """The dtype of the adapter's factors (that of its delta weight)."""
        return next(getattr(module, n)[adapter] for n in self.factor_names if adapter in getattr(module, n)).dtype

    @staticmethod
    def _mismatch(module: nn.Module, call: LycorisCall, draws: list) -> UnsupportedModuleError:
        return UnsupportedModuleError(
            f"{type(module).__name__} ({type(module).__module__}) drew {[tuple(t.shape) for _, t in draws]} in a "
            f"{'training' if call.training else 'evaluation'} forward pass with adapters "
            f"{[a[0] for a in call.adapters]}, not the `torch.rand(1)` per adapter (and the rank-dropout mask) of "
            "peft's LyCORIS forward that hf_dp reads; its per-example gradients would be guesses. Freeze the adapter, "
            "or report the peft version."
        )
