"""``BookKeepingClipper``: per-example clipping in one backward pass (Bu et al. 2023, book-keeping).

Life of one micro-batch:

1. forward: the root pre-hook switches ``requires_grad`` off on the trainable parameters (ghost differentiation:
   autograd never computes their non-private gradients) and back on in the post-hook, once the graph is built; each
   hooked module keeps its inputs (book-keeping, detached references) and registers a hook on its outputs. On the
   first forward after a (re)plan the engine first proves the plan on sub-batches (:mod:`.probe`, :mod:`.planner`)
   and then verifies it on the real forward (:mod:`.verify`).
2. ``prepare(loss)``: the loss must be ``[B]``; on the first batch of a plan, the engine checks that loss ``j``
   depends on the rows of example ``j`` alone in every hooked output (two extra backward passes, once).
3. backward: each output hook receives the output gradient ``g`` and adds its layers' per-example squared norms to
   their clipping group's (ghost norm, or instantiation where BK-MixOpt prefers it). With several clipping groups
   (:mod:`.policy`), a group whose uses have all been seen is clipped right there and its factors freed
   (:mod:`.clipping`).
4. ``finish()`` (never inside a hook for one group): parameters used more than once get their exact cross terms,
   group norms give ``c_{i,g}`` (:class:`~.policy.ClippingPolicy`), and ``p.grad += sum_i c_{i,g} g_{i,g}`` is formed
   from the book-kept factors under ``no_grad`` (``p.grad`` never carries a graph), or handed to ``grad_sink``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping

from torch import Tensor, nn

from ..layers import UnsupportedModuleError, spec_augment
from .backward import BackwardBookkeeping
from .bnb_packing import hold_cpu_repacking, release_cpu_repacking
from .capture import CallCapture
from .clipping import GroupClipping
from .coverage import plan_coverage, trainable_parameters
from .forward import ForwardHooks
from .grad_hooks import GradHooks
from .listing import ModelListing
from .packed import PackedSequences
from .packed_check import packed_self_check
from .planner import Plan
from .policy import ClippingPolicy, ParameterGroups
from .proof import PlanProof
from .regions import CheckpointRegions
from .self_check import self_check
from .shared_outputs import SharedOutputs
from .state import ModelHook, Pass
from .verify import Verification

logger = logging.getLogger(__name__)

__all__ = ["CLIPPING_MODES", "BookKeepingClipper"]

#: Clipping modes and what they do.
CLIPPING_MODES: dict[str, str] = {
    "bk": "ghost norm for every sequence layer, clipped sum from the book-kept factors (one backward)",
    "bk-mixopt": "per layer: ghost norm when 2T^2 < p*d, else instantiate the per-example gradient (one backward)",
    "per-sample": "instantiate every per-example gradient (Opacus-style, one backward)",
    "ghost": "GhostClip baseline: ghost norms from a first backward, then a second backward of the reweighted loss",
}


class BookKeepingClipper(
    ForwardHooks,
    PlanProof,
    CallCapture,
    SharedOutputs,
    CheckpointRegions,
    BackwardBookkeeping,
    GroupClipping,
    GradHooks,
    PackedSequences,
):
    """Per-example gradient clipping for any ``nn.Module``, by book-keeping, in one backward pass.

    Args:
        model (`nn.Module`): the model; every parameter with ``requires_grad`` is clipped per example. Its tensor
            inputs carry the examples along dimension 0.
        max_grad_norm (`float`): the clipping norm ``C`` (for a loss scaled by ``K``, pass ``K * C``).
        mode (`str`, *optional*, defaults to `"bk-mixopt"`): one of :data:`CLIPPING_MODES`.
        allow_fallback (`bool`, *optional*, defaults to `True`): use the torch.func rule for modules with trainable
            parameters and no closed-form rule, and for parameters used where no rule sees them; if `False`, such
            modules raise ``UnsupportedModuleError``.
        clipping_style (`str` or `list[list[str]]`, *optional*, defaults to `"all-layer"`): how the parameters are
            grouped for clipping (:data:`~hf_dp.engine.policy.CLIPPING_STYLES`: `"all-layer"`, `"layer-wise"`,
            `"param-wise"`), or groups of ``fnmatch`` patterns over ``model.named_parameters()`` names. Each of the
            ``G`` groups is clipped at ``C / sqrt(G)`` (He et al. 2022), so the sensitivity stays ``C``. With more
            than one group each group is clipped inside the backward pass as soon as all its uses are seen, and its
            book-kept factors are freed there (pass the loss scale to :meth:`prepare`).
        clipping_fn (`str`, *optional*, defaults to `"abadi"`): `"abadi"`, ``min(1, C_g / (||g_{i,g}|| + 1e-6))``,
            or `"automatic"`, ``C_g / (||g_{i,g}|| + gamma)`` (Bu et al. 2023).
        gamma (`float`, *optional*, defaults to 0.01): ``gamma`` of automatic clipping (> 0).
        grad_sink (`Callable[[nn.Parameter, torch.Tensor], None]`, *optional*): called once per trainable parameter
            per micro-batch with its clipped sum (full size; zeros if no use reached it) instead of
            ``p.grad += clipped_sum`` (e.g. to reduce-scatter into a sharded gradient). With several groups it is
            called inside the backward pass, from the hook that completes the parameter's group; with one group,
            after the backward pass, parameter by parameter.
        registered_parameters (`Mapping[nn.Parameter, nn.Parameter]`, *optional*): for a model whose modules hold
            other parameters during the forward pass than between steps (FSDP2 swaps each sharded parameter for an
            unsharded one): the registered parameter of each parameter the forward pass uses. The clipper must be
            built while the model holds the used ones (:mod:`hf_dp.step.fsdp` does this).
        packed_sequences (`bool`, *optional*, defaults to `False`): the rows hold several sequences each (TRL's
            padding-free packing: ``position_ids`` restarting at each sequence, no attention mask), and each sequence
            is one example: the loss is ``[S]`` for the ``S`` sequences and everything is per sequence
            (:mod:`hf_dp.engine.packed`; token-wise layers only).

    Raises:
        UnsupportedModuleError: BatchNorm anywhere in the model, or a trainable parameter no rule covers (at
            construction); a parameter, layer or layout the engine cannot make exact (at the first forward pass, with
            what to change).
        ValueError: an unknown mode, style or function, a non-positive clipping norm or gamma, clipping groups that
            leave a trainable parameter out or count it twice, or a clipping style other than `"all-layer"` in
            `"ghost"` mode.

    Example:
        ```python
        clipper = BookKeepingClipper(model, max_grad_norm=0.1, clipping_style="layer-wise")
        loss = per_example_loss(model(**batch), batch)  # [B]
        clipper.backward(loss)  # p.grad += sum_i sum_g min(1, C_g / ||g_{i,g}||) g_{i,g}
        clipper.per_example_norms  # [B] total norms ([U] with `units`); clipper.per_group_norms: [G, B]
        clipper.remove()
        ```
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_grad_norm: float,
        mode: str = "bk-mixopt",
        allow_fallback: bool = True,
        clipping_style: str | list[list[str]] = "all-layer",
        clipping_fn: str = "abadi",
        gamma: float = 0.01,
        grad_sink: Callable[[nn.Parameter, Tensor], None] | None = None,
        registered_parameters: Mapping[nn.Parameter, nn.Parameter] | None = None,
        packed_sequences: bool = False,
    ) -> None:
        self.policy = _checked_policy(mode, max_grad_norm, clipping_style, clipping_fn, gamma, grad_sink)
        self.model = model
        self.mode = mode
        self.allow_fallback = allow_fallback
        self.packed_sequences = bool(packed_sequences)
        self.grad_sink = grad_sink
        self.per_example_norms: Tensor | None = None
        self.per_group_norms: Tensor | None = None
        self._registered: dict[nn.Parameter, nn.Parameter] = dict(registered_parameters or {})
        self._used_of: dict[int, nn.Parameter] = {id(twin): p for p, twin in self._registered.items()}
        listing = ModelListing.of(model)  # read by each step below (listed again if one adds modules)
        self._original_requires_grad = {p: p.requires_grad for p in listing.parameters}
        self._original_requires_grad.update({twin: twin.requires_grad for twin in self._registered.values()})
        self._check_grad_hooks(listing)  # hooks the engine cannot apply per example are refused (grad_hooks)
        # bitsandbytes' CPU repacking breaks its backward (held off until remove)
        self._bnb_held = hold_cpu_repacking(model, listing.named_modules)
        # SpecAugment's masking runs as a child's call while the clipper is installed (undone by `remove()`)
        self._spec_augment = spec_augment.install(model, listing.modules)
        listing = ModelListing.of(model) if self._spec_augment else listing
        try:
            self._static = plan_coverage(model, allow_fallback=allow_fallback, listing=listing)
        except BaseException:
            spec_augment.uninstall(self._spec_augment)
            release_cpu_repacking(self._bnb_held)
            raise
        self._trainable = tuple(trainable_parameters(model, listing))
        self._set_groups()
        self._warned_scale = False
        # the modules that can turn gradient checkpointing on (transformers sets this attribute), checked per forward
        self._checkpointable = [m for m in listing.modules if hasattr(m, "gradient_checkpointing")]
        self._init_engine_state()
        self._norm_dtype = self._compute_norm_dtype()
        #: Whether the engine may run passes of its own on this process's examples (the proof of a plan, the
        #: support check); a sharded model (FSDP2) allows them only while no such pass can start a collective.
        self.allow_own_passes = True
        self._root_handles = [
            model.register_forward_pre_hook(ModelHook(self._on_root_start), with_kwargs=True, prepend=True),
            model.register_forward_hook(ModelHook(self._on_root_end), always_call=True),
        ]

    def _init_engine_state(self) -> None:
        """The state of the plan and of the forward and backward passes, as before the first forward pass."""
        self._plan: Plan | None = None
        self._plan_handles: list = []
        self._verification: Verification | None = None
        self._verified: bool | None = None  # model.training of the last verified forward (None: not yet)
        self._support_checked = False
        self._sum_checked = False  # ghost mode: engine sums vs autograd, once per plan
        self._pass: Pass | None = None
        self._prepared = False
        self._capturing = False
        self._internal = 0  # > 0 while the engine runs the model or a rule itself: every hook stands aside
        self._force_ghost_diff = False
        self._shadow_depth: dict[nn.Parameter, int] = defaultdict(int)
        self._shadow_start: dict[int, list[nn.Parameter]] = {}
        self._fallback_modules: dict[int, str] = {}  # id -> path of the modules whose random draws are recorded
        self._record_random = False
        self._recorder = None
        self._origins: dict[tuple, Tensor] = {}
        self._root_call: tuple | None = None  # (args, kwargs, batch) of the forward pass in progress
        self._early_stop = None  # checkpoint early stop switched off during the forward pass
        self._recomputing = False  # parameters switched off during a checkpointed region's recomputation
        self._packed_plan: Plan | None = None  # packed sequences: the plan whose modules were checked token-wise

    @property
    def max_grad_norm(self) -> float:
        """``C``, the total clipping norm (the policy's)."""
        return self.policy.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        """Set ``C`` for the next backward pass (adaptive clipping moves it between optimizer steps)."""
        if not value > 0:
            raise ValueError(f"`max_grad_norm` must be > 0, got {value}.")
        self.policy.max_grad_norm = float(value)

    # ------------------------------------------------------------------ public helpers
    def needs_own_passes(self, batch_size: int) -> bool:
        """Whether a training micro-batch of ``batch_size`` examples may make the engine run passes of its own on them
        (the proof of a plan; the support check, on the first batch of two or more examples)."""
        if batch_size == 0:
            return False
        if self._plan is None or (self.mode == "ghost" and not self._sum_checked):
            return True
        return not self._support_checked and batch_size >= 2

    def _check_own_passes(self, what: str) -> None:
        if not self.allow_own_passes:
            raise UnsupportedModuleError(
                f"hf_dp needs to {what} on this process's examples alone, which it allows on a sharded model (FSDP2) "
                "only in the micro-batches where every process has the whole model (DPTrainer arranges them at the "
                "start of a plan): a model that takes a new path through its modules in the middle of training "
                "cannot be sharded. Make the model take the same path for every batch (e.g. always pass an "
                "attention mask), or train without FSDP."
            )

    @property
    def hooked_modules(self) -> list[tuple[str, str]]:
        """``(module name, rule name)`` for every module the engine hooks (the proven plan once a batch was seen)."""
        entries = self._plan.hooked if self._plan is not None else self._static
        return [(h.name, type(h.rule).__name__) for h in entries]

    @property
    def group_names(self) -> list[list[str]]:
        """The clipping groups, as lists of parameter names (the row order of :attr:`per_group_norms`)."""
        return [list(names) for names in self._groups.names]

    def _set_groups(self) -> None:
        self._groups: ParameterGroups = self.policy.groups(self.model, list(self._trainable))
        self._group_of = self._groups.index()

    def remove(self) -> None:
        """Remove every hook and restore the parameters' ``requires_grad``: the model is a plain model again."""
        self._end_capture()
        self._recomputing = False
        for handle in self._root_handles + self._plan_handles:
            handle.remove()
        self._root_handles, self._plan_handles = [], []
        for p, flag in self._original_requires_grad.items():
            p.requires_grad_(flag)
        spec_augment.uninstall(self._spec_augment)
        self._spec_augment = []
        release_cpu_repacking(self._bnb_held)
        self._bnb_held = []
        self._plan, self._pass, self._prepared, self._capturing = None, None, False, False
        self._origins = {}
        self._shadow_depth = defaultdict(int)

    def self_check(
        self,
        inputs: dict,
        per_example_loss: Callable[[nn.Module, dict], Tensor],
        *,
        num_examples: int = 2,
    ) -> float:
        """Compare the engine's per-example gradient norms with plain per-example autograd on a real micro-batch.

        Without changing the random number streams, the engine computes per-parameter per-example norms of
        ``per_example_loss(model, inputs)`` cut to its first ``num_examples`` examples in a norms-only pass (no
        ``p.grad``, no clipper state touched), and plain autograd gives each example's own: in training mode when (part
        of) the model is in it (each loss of the batched forward differentiated alone, the random draws replayed),
        else, or if they cannot be replayed, in eval mode (training flags restored afterwards) with each example run
        alone (every batch tensor of ``inputs`` sliced to ``[i:i+1]``), the clipper's hooks standing aside. The checks
        of a whole micro-batch (each loss depends on its own example alone; every use of a parameter covered) are not
        taken from the cut: they run on the next micro-batch.
        Every parameter is compared on its own: an error fails beyond float64 1e-6, float32 1e-3, bfloat16/float16
        5e-2 of the example's total norm, or beyond 1e-6, 1e-2, 2e-1 of the parameter's own norm (above a round-off
        floor; :mod:`hf_dp.engine.self_check`), so a small parameter that is wrong fails too.

        Args:
            inputs (`dict`): a micro-batch, as ``per_example_loss`` takes it.
            per_example_loss (`Callable[[nn.Module, dict], torch.Tensor]`): ``(model, inputs) -> [B]``, e.g. calling
                ``model(**inputs)``.
            num_examples (`int`, *optional*, defaults to 2): how many examples to compare.

        Returns:
            `float`: the largest relative error found.

        Raises:
            SelfCheckError: naming the parameters whose per-example norms differ.

        Example:
            ```python
            clipper.self_check(batch, lambda m, b: causal_lm_loss(m(**b).logits, b["labels"]))
            ```
        """
        self._check_own_passes("run the self-check")
        if self.packed_sequences:  # each checked sequence against itself run alone, unpacked
            return packed_self_check(self, inputs, per_example_loss, num_examples=num_examples)
        return self_check(self, inputs, per_example_loss, num_examples=num_examples)

    def backward(self, per_example_loss: Tensor, *, units=None) -> Tensor:
        """Accumulate ``sum_i c_i g_i`` into ``p.grad`` of every trainable parameter (group by group with several
        clipping groups; :attr:`policy` gives ``c``).

        One ``per_example_loss.sum().backward()`` (two in ``"ghost"`` mode), then the clipped sum.

        Args:
            per_example_loss (`torch.Tensor`): shape ``[B]``; entry ``i`` must depend on example ``i`` alone.
            units (`Sequence[int]` or CPU `torch.Tensor`, *optional*): the privacy unit of every example (codes
                ``0 .. U-1``, e.g. one per user): each unit's gradient ``sum_{i in u} g_i`` is clipped as one, and
                the norms and coefficients are per unit (``[U]``). Read on the host (pass a CPU tensor: no sync).

        Returns:
            `torch.Tensor`: the clipping coefficients (0 for an example whose gradient is not finite): ``[B]`` with
            one clipping group, ``[G, B]`` with several.

        Raises:
            ValueError: a loss that is not ``[B]`` for the batch of the last forward pass, or no forward pass.
            UnsupportedModuleError: a loss that couples examples (checked on the first batch).
        """
        self._begin(per_example_loss, keep_all=False, loss_scale=1.0, units=units)
        if self._pass.size > 0 and self._pass.uses:
            try:
                per_example_loss.sum().backward(retain_graph=self.mode == "ghost")
            except BaseException:
                self.abandon()
                raise
        return self.finish(per_example_loss if self.mode == "ghost" else None)

    def abandon(self) -> None:
        """Drop the pass between ``prepare()`` and ``finish()`` after an error in the backward pass (a refusal
        raised in a hook): in ``"ghost"`` mode autograd's un-clipped sums are replaced by ``p.grad`` as it was at
        ``prepare()``; in the one-backward modes autograd writes none, and a group a hook already clipped stays."""
        p = self._pass
        if self._prepared and p is not None and self.mode == "ghost" and p.grads_before is not None:
            for q in self._trainable:
                q.grad = p.grads_before.get(q)
        self._prepared, self._pass = False, None
        self._recompute_leave()

    def prepare(self, per_example_loss: Tensor, *, loss_scale: float | None = None, units=None) -> None:
        """Start book-keeping the backward pass of ``per_example_loss`` that the caller is about to run.

        For callers that run the backward themselves (the Trainer, through accelerate's loss scaling): call
        ``prepare(loss, loss_scale=w)``, then any backward of ``w * loss.sum()`` (``w`` a positive constant, e.g. a
        loss scale), then ``finish()``; ``p.grad`` then receives ``w * sum_i clip_C(g_i)``.

        Args:
            per_example_loss (`torch.Tensor`): shape ``[B]``, from the last forward pass.
            loss_scale (`float`, *optional*): ``w``. With several clipping groups the groups are clipped inside the
                backward pass only if ``w`` is known here (else in ``finish``, with the same result but no memory
                saving); ``finish`` may then omit it.
            units (`Sequence[int]` or CPU `torch.Tensor`, *optional*): the privacy unit of every example, as in
                :meth:`backward` (clipping per unit).

        Raises:
            ValueError: no forward pass with gradients since the last ``finish()``, a loss that is not ``[B]``, or a
                non-positive ``loss_scale``.
            UnsupportedModuleError: a loss that couples examples (checked on the first batch).
        """
        self._begin(per_example_loss, keep_all=False, loss_scale=loss_scale, units=units)

    def finish(self, per_example_loss: Tensor | None = None, *, loss_scale: float | None = None) -> Tensor:
        """Clip after the backward pass has finished and add the clipped sum to ``p.grad`` (or hand it to
        ``grad_sink``); groups already clipped inside the backward pass are done.

        Args:
            per_example_loss (`torch.Tensor`, *optional*): the same loss again, for ``"ghost"`` mode's second backward.
            loss_scale (`float`, *optional*): ``w`` if the backward ran on ``w * loss.sum()`` (defaults to the one
                given to :meth:`prepare`, else 1): norms are divided by it before clipping (so clipping happens at
                ``w * C`` in the units of the backward, as in Li et al. 2022, App. T, for fp16 loss scaling) and
                ``p.grad`` receives ``w`` times the clipped sum.

        Returns:
            `torch.Tensor`: the clipping coefficients, ``[B]`` with one clipping group, ``[G, B]`` with several.

        Raises:
            ValueError: ``prepare()`` was not called since the last ``finish()``; a ``loss_scale`` other than the one
                given to ``prepare()``; no hooked module received an output gradient (the loss does not depend on the
                model's forward pass, or the backward did not run); or a parameter received a gradient that bypassed
                the clipper (used outside the model's forward pass).
        """
        if loss_scale is not None and not loss_scale > 0:
            raise ValueError(f"`loss_scale` must be > 0, got {loss_scale}.")
        if not self._prepared:
            raise ValueError(
                "`finish()` without `prepare()`: call `prepare(per_example_loss)` after the forward pass and before "
                "the backward pass of every micro-batch (or use `backward()`)."
            )
        p = self._pass
        if p.loss_scale is not None and loss_scale is not None and loss_scale != p.loss_scale:
            raise ValueError(
                f"`finish(loss_scale={loss_scale})` differs from the `loss_scale={p.loss_scale}` given to "
                "`prepare()` (groups may already be clipped with it inside the backward pass). Pass the same value."
            )
        self._prepared, self._pass = False, None
        p.phase = None
        self._recompute_leave()
        try:
            return self._finish(p, per_example_loss, loss_scale)
        except BaseException:
            if self.mode == "ghost" and p.grads_before is not None:  # autograd's un-clipped sum must not stay there
                for q in self._trainable:
                    q.grad = p.grads_before.get(q)
            raise


def _checked_policy(
    mode: str, max_grad_norm: float, clipping_style, clipping_fn: str, gamma: float, grad_sink
) -> ClippingPolicy:
    """The clipping policy of a :class:`BookKeepingClipper`, once its arguments are checked (``ValueError`` for an
    unknown mode or a style ``ghost`` mode cannot clip, ``TypeError`` for a ``grad_sink`` that is not callable)."""
    if mode not in CLIPPING_MODES:
        raise ValueError(f"Unknown clipping mode {mode!r}. Choose one of {sorted(CLIPPING_MODES)}.")
    policy = ClippingPolicy(max_grad_norm=max_grad_norm, style=clipping_style, fn=clipping_fn, gamma=gamma)
    if mode == "ghost" and not policy.is_all_layer:
        raise ValueError(
            f"`clipping_style`={clipping_style!r} is not supported in `ghost` mode, whose second backward pass "
            "reweights whole examples (one coefficient per example). Use `clipping_style='all-layer'`, or a "
            "one-backward mode (`bk`, `bk-mixopt`, `per-sample`) for group-wise clipping."
        )
    if grad_sink is not None and not callable(grad_sink):
        raise TypeError(f"`grad_sink` must be a callable (param, clipped_sum), got {type(grad_sink).__name__}")
    return policy
