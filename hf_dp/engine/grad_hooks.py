"""Gradient hooks on the trainable parameters and modules: honoured per example, or refused (DESIGN §24).

Book-keeping forms each example's gradient itself and writes ``p.grad`` outside autograd, so a hook that autograd
would run on a parameter's gradient does not run by itself. Which gradient is right: the one the user's training
gives the optimizer for that example alone, ``h(g_i)`` for a tensor hook ``h`` (what autograd forms for a batch of one
example). DP clips and sums per example, so the clipped quantity is ``h(g_i)``: ``p.grad += sum_i c_i h(g_i)``, with
``c_i`` from the norms of the hooked gradients. For a linear hook (peft's OSF projections) this equals the hook of
the clipped sum, ``h(sum_i c_i g_i)``; for any other hook only the per-example form is the gradient of each example,
so it is the one applied, always (no linearity is assumed anywhere).

* A tensor hook (``p.register_hook(h)``; peft's OSF projects the gradients of ``U_low`` / ``V_low`` so, peft's CPT
  masks its embedding's): the engine instantiates the parameter's per-example gradients (summed over its uses in the
  pass, as autograd hands the hook the whole gradient of the leaf), in the parameter's dtype, and runs the hooks in
  registration order on each example's gradient alone (:func:`apply_per_example`: ``torch.func.vmap``, or a loop
  where vmap cannot run the hook), before the norms are taken. The hook is never applied twice: in the one-backward
  modes the parameters are out of autograd, so autograd never calls it; in ``ghost`` mode autograd also calls it on
  the batch's sums in its two backward passes, and the engine discards those results (the first pass's only checks
  the rules once per plan, against ``h(sum_i g_i)``; the second's is replaced by ``sum_i c_i h(g_i)``). With a loss
  scale ``w`` the hook sees the scaled gradients, as under autograd.
* Refused when the clipper is built and at every new plan (:class:`UnsupportedModuleError`, naming the parameter or
  module and the hook): a post-accumulate-grad hook (it runs after autograd accumulates ``p.grad``, which book-keeping
  never does; one that steps an optimizer or changes ``p.grad`` would act on an un-clipped, un-noised sum), and a
  module's backward hook or backward pre-hook, or a global one (they see the gradients of the whole batch, and hf_dp
  cannot tell that each example's gradient is transformed alone). The engine's own hooks (:class:`.state.ModelHook`)
  are not counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from ..layers import UnsupportedModuleError
from ..layers.grads import InstantiatedGrad, PerExampleGrad, instantiate
from .listing import ModelListing
from .state import ModelHook, Pass

__all__ = ["GradHooks", "apply_per_example", "check_gradient_hooks", "run_hooks", "tensor_hooks"]


def tensor_hooks(p: Tensor) -> tuple[Callable, ...]:
    """The hooks ``p.register_hook`` put on ``p``, in the order autograd runs them."""
    hooks = p._backward_hooks
    return tuple(hooks.values()) if hooks else ()


def describe(hook: Callable) -> str:
    """A hook's name for a message (``functools.partial`` unwrapped)."""
    fn = hook.func if isinstance(hook, functools.partial) else hook
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    where = getattr(fn, "__module__", None)
    return f"{where}.{name}" if where else name


def check_gradient_hooks(
    model: nn.Module, params: Iterable[Tensor], named_modules: Iterable[tuple[str, nn.Module]] | None = None
) -> None:
    """Refuse the hooks the engine cannot honour (see the module docstring): post-accumulate-grad hooks on
    ``params`` (the trainable parameters), and backward hooks or backward pre-hooks on any module of ``model`` or
    global ones. ``named_modules``: ``model.named_modules()``, if the caller has just listed them.

    Raises:
        UnsupportedModuleError: naming the parameter or module, the hook, and what to do.
    """
    params = list(params)
    _refuse_post_accumulate_hooks(model, params)
    _refuse_gradient_loggers(model, params)
    _refuse_module_backward_hooks(model.named_modules() if named_modules is None else named_modules)


#: Modules whose tensor hooks log the gradients they see (``wandb.watch(model, log="gradients" | "all")``, which
#: transformers' ``WandbCallback`` calls when ``WANDB_WATCH`` says so): applied per example, they would publish each
#: example's un-clipped, un-noised gradient.
GRADIENT_LOGGERS = ("wandb",)


def _refuse_gradient_loggers(model: nn.Module, params: Iterable[Tensor]) -> None:
    for p in params:
        for hook in tensor_hooks(p):
            fn = hook.func if isinstance(hook, functools.partial) else hook
            if (getattr(fn, "__module__", None) or "").split(".")[0] in GRADIENT_LOGGERS:
                name = next((n for n, q in model.named_parameters() if q is p), f"of shape {tuple(p.shape)}")
                raise UnsupportedModuleError(
                    f"Trainable parameter `{name}` has a gradient hook that logs what it sees (`{describe(hook)}`, "
                    "e.g. `wandb.watch(model, log='gradients' or 'all')`): hf_dp runs a parameter's hooks on each "
                    "example's un-clipped, un-noised gradient, which would then be published. Watch the parameters "
                    "only (`wandb.watch(model, log='parameters')`, or `WANDB_WATCH=false` with the Trainer), or "
                    "unwatch the model (`wandb.unwatch(model)`)."
                )


def _refuse_post_accumulate_hooks(model: nn.Module, params: Iterable[Tensor]) -> None:
    names = None
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks:
            names = names if names is not None else {q: n for n, q in model.named_parameters()}
            raise UnsupportedModuleError(
                f"Trainable parameter `{names.get(p, f'of shape {tuple(p.shape)}')}` has a post-accumulate-grad hook "
                f"(`{describe(next(iter(hooks.values())))}`): it runs on `p.grad` after autograd accumulates it, "
                "which book-keeping never does (hf_dp writes the clipped sum itself), and a hook that steps an "
                "optimizer or changes `p.grad` there would act on an un-clipped, un-noised sum. Remove the hook "
                "(`handle.remove()`; a layer-wise optimizer: use one that steps once per logical batch), or freeze the "
                "parameter (`requires_grad_(False)`)."
            )


def _refuse_module_backward_hooks(named_modules: Iterable[tuple[str, nn.Module]]) -> None:
    fix = (
        "Remove the hook (`handle.remove()`), or put the transform on the parameters' own gradients "
        "(`p.register_hook(fn)`), which hf_dp applies to each example's gradient."
    )
    global_tables = (
        ("backward hook", "register_module_full_backward_hook", module_hooks._global_backward_hooks),
        ("backward pre-hook", "register_module_full_backward_pre_hook", module_hooks._global_backward_pre_hooks),
    )
    for kind, registrar, table in global_tables:
        hooks = [h for h in table.values() if not isinstance(h, ModelHook)]
        if hooks:
            raise UnsupportedModuleError(
                f"A global module {kind} is registered (`{describe(hooks[0])}`, by "
                f"`torch.nn.modules.module.{registrar}`): it sees the gradients of the whole batch, and hf_dp, which "
                f"forms each example's gradient itself, cannot tell that it transforms each example's alone. {fix}"
            )
    for name, module in named_modules:
        for kind, table in (
            ("backward hook", module._backward_hooks),
            ("backward pre-hook", module._backward_pre_hooks),
        ):
            hooks = [h for h in table.values() if not isinstance(h, ModelHook)] if table else []
            if hooks:
                raise UnsupportedModuleError(
                    f"Module `{name}` ({type(module).__name__}) has a {kind} (`{describe(hooks[0])}`): it sees the "
                    "gradients of the whole batch, and hf_dp, which forms each example's gradient itself, cannot tell "
                    f"that it transforms each example's alone. {fix}"
                )


def run_hooks(hooks: tuple[Callable, ...], grad: Tensor) -> Tensor:
    """``grad`` through ``hooks`` in order, as autograd chains them (a hook returning ``None`` keeps its input)."""
    for hook in hooks:
        out = hook(grad)
        if out is not None:
            if not isinstance(out, Tensor):
                raise TypeError(f"a gradient hook returned {type(out).__name__}, not a tensor or None")
            grad = out
    return grad


def apply_per_example(hooks: tuple[Callable, ...], grads: Tensor, name: Callable[[], str]) -> Tensor:
    """``[B, *shape]`` per-example gradients -> each one through ``hooks`` alone (``torch.func.vmap``; a loop over the
    examples for a hook vmap cannot run: data-dependent control flow, ``.item()``, random draws).

    Raises:
        UnsupportedModuleError: a hook that fails on one example's gradient or changes its shape (``name()``: the
            parameter's name, for the message).
    """
    if grads.shape[0] == 0:
        return grads
    try:
        out = torch.func.vmap(functools.partial(run_hooks, hooks), randomness="error")(grads.clone())
    except Exception:  # noqa: BLE001  (any hook vmap cannot run: the loop gives the same per-example semantics)
        try:
            out = torch.stack([run_hooks(hooks, grads[i].clone()) for i in range(grads.shape[0])])
        except Exception as err:
            raise UnsupportedModuleError(
                f"The gradient hook `{describe(hooks[0])}` of trainable parameter `{name()}` failed on one example's "
                f"gradient ({type(err).__name__}: {' '.join(str(err).split())[:300]}): hf_dp applies a parameter's "
                "hooks to each example's gradient alone (the gradient the example contributes), so a hook must work "
                "on the gradient of any batch. Remove the hook or freeze the parameter. Nothing was added to `p.grad`."
            ) from err
    if out.shape != grads.shape:
        raise UnsupportedModuleError(
            f"The gradient hook `{describe(hooks[0])}` of trainable parameter `{name()}` changed the gradient's shape "
            f"from {tuple(grads.shape[1:])} to {tuple(out.shape[1:])}. Nothing was added to `p.grad`."
        )
    return out.to(grads.dtype)


class GradHooks:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: the parameters' gradient hooks, checked and applied."""

    def _check_grad_hooks(self, listing: ModelListing | None = None) -> None:
        """Refuse the hooks the engine cannot honour (at construction and at every new plan). ``listing``: the
        model's, if the caller has just listed it."""
        listing = ModelListing.of(self.model) if listing is None else listing
        params = [p for p in listing.parameters if p.requires_grad]
        params += [q for pair in self._registered.items() for q in pair if q.requires_grad]
        check_gradient_hooks(self.model, params, listing.named_modules)

    def _hooks_of(self, q: nn.Parameter) -> tuple[Callable, ...]:
        """The tensor hooks of trainable parameter ``q`` (and of its registered twin, FSDP2)."""
        twin = self._registered.get(q)
        return tensor_hooks(q) + (tensor_hooks(twin) if twin is not None and twin is not q else ())

    def _current_grad_hooks(self) -> dict[nn.Parameter, tuple[Callable, ...]]:
        """The hooked trainable parameters and their hooks, read when a backward pass starts (``prepare()``)."""
        hooks_of = self._hooks_of if self._registered else tensor_hooks  # no twins without FSDP2
        hooked = {q: hooks for q in self._trainable if (hooks := hooks_of(q))}
        if hooked:  # a logger's hook registered after the plan (wandb.watch at on_train_begin) is refused too
            _refuse_gradient_loggers(self.model, hooked)
        return hooked

    def _hooked_grad(self, p: Pass, q: nn.Parameter, parts: list[PerExampleGrad]) -> InstantiatedGrad:
        """``h(g_i)`` for each example (unit) of the pass: the per-use gradients of ``q`` instantiated and summed, in
        the parameter's dtype (what autograd hands the hook), then run through its hooks one example at a time."""
        dtype = self._registered.get(q, q).dtype
        dense = None
        for part in parts:
            value = instantiate(part, dtype).value.to(dtype)
            dense = value if dense is None else dense + value
        hooks = p.hooked[q]
        if self.mode == "ghost" and not self._sum_checked:  # ghost mode's check: autograd ran the hooks on the sum
            p.hook_sums[q] = run_hooks(hooks, dense.sum(0)).double()
        return InstantiatedGrad(apply_per_example(hooks, dense, lambda: self._names()[1].get(q, "?")))
