"""State of the engine between hooks: the hooks it puts on the model, one call of a hooked module, one pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..layers import Captured
from ..layers.grads import PerExampleGrad
from .batch import RootBatch
from .coverage import HookedModule
from .planner import CallLayout

__all__ = ["ModelHook", "Pass", "Use", "expand_output", "grad_stamp"]


class ModelHook:
    """A hook the engine puts on the user's model. A deep copy or a pickle of the model gets an inert one, so that
    ``copy.deepcopy(model)`` and ``torch.save(model)`` work while the clipper is installed (the copy is plain)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable | None = None) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return None if self.fn is None else self.fn(*args, **kwargs)

    def __deepcopy__(self, memo) -> ModelHook:
        return ModelHook()

    def __reduce__(self):
        return (ModelHook, ())


@dataclass(eq=False)
class Use:
    """One call of a hooked module in the current forward pass."""

    entry: HookedModule
    params: list[nn.Parameter]
    captured: Captured | None
    layout: CallLayout
    groups: tuple[int, ...] = ()  # the clipping groups of its parameters (set by `prepare`)
    region: Any = None  # the checkpoint frame of a call inside activation checkpointing (inputs come in recomputation)
    reentrant: bool = False  # its region is reentrant: ``region`` is the region's node, its output hook comes with it
    pending_grad: Any = None  # an output gradient that arrived before the recomputation
    processed: bool = False  # its per-example gradients are book-kept
    versions: list = field(default_factory=list)  # (hooked tensor, version) until prepare(): a write drops its hook


@dataclass(eq=False)
class Pass:
    """State of one forward/backward pass."""

    batch: RootBatch
    ghost_diff: bool
    keep_all: bool = False  # keep every per-use gradient (the self-check's per-parameter norms)
    ordinal: dict[int, int] = field(default_factory=dict)  # module -> ordinal of its current call
    counts: dict[int, int] = field(default_factory=dict)
    uses: list[Use] = field(default_factory=list)
    phase: str | None = None  # None, "record" (our backward), "support" (the first-batch layout check)
    support_example: int = 0
    support_failures: list[str] = field(default_factory=list)
    support_flags: list = field(default_factory=list)  # (module name, 0-dim count of foreign entries), read at once
    norm_sq: Tensor | None = None  # [G, B] squared per-example norms of each clipping group (in backward units)
    norm_parts: dict = field(default_factory=dict)  # group -> [B] terms of its norm not yet added to norm_sq
    norm_dense: dict = field(default_factory=dict)  # group -> instantiated gradients whose norms are not yet added
    use_counts: dict[int, int] = field(default_factory=dict)  # id(parameter) -> its uses in the pass
    pieces: dict[nn.Parameter, list[PerExampleGrad]] = field(default_factory=dict)  # book-kept, not yet clipped
    pending: list[int] = field(default_factory=list)  # per group: uses whose output gradient has not arrived
    done: list[bool] = field(default_factory=list)  # per group: clipped sum delivered
    coef: Tensor | None = None  # [G, B] coefficients of the groups clipped so far
    loss_scale: float | None = None  # w of the backward of w * loss.sum(), if known at `prepare`
    in_hook: bool = False  # clip each group inside the backward, as soon as all its uses are seen
    bypassed: set = field(default_factory=set)  # parameters whose p.grad autograd wrote before we did
    grad_events: int = 0
    regions: dict = field(default_factory=dict)  # id(checkpoint frame) -> regions.Region
    recomputing: dict = field(default_factory=dict)  # thread -> reentrant regions it recomputes (regions.Region)
    record_random: bool = False  # random draws of fallback modules recorded in the forward pass (and recomputation)
    grads_before: dict | None = None  # ghost mode: p.grad before the first backward; bk: (id, version) of p.grad
    complete: bool = False  # the forward pass returned
    units: Any = None  # grads.Units: clip per privacy unit (several examples); None: per example
    hooked: dict = field(default_factory=dict)  # parameter -> its tensor hooks, applied per example (grad_hooks)
    hook_sums: dict = field(default_factory=dict)  # ghost mode's check: the hooks run on the sum, as autograd does
    segments: Any = None  # packed.Segments: the examples are the sequences packed into the rows; None: the rows
    shared: Any = None  # shared_outputs.SharedState: outputs computed once for the batch, and copies of them

    @property
    def examples(self) -> int:
        """The number of examples: the rows of the batch, or the sequences packed into them."""
        return self.size if self.segments is None else self.segments.count

    @property
    def num_units(self) -> int:
        """The number of clipped units: examples, or the privacy units (users) they belong to."""
        return self.examples if self.units is None else self.units.count

    @property
    def size(self) -> int:
        return self.batch.size


def grad_stamp(p: nn.Parameter) -> tuple:
    g = p.grad
    return (None, None) if g is None else (id(g), g._version)


def expand_output(expand: dict, batch_size: int, record, output):
    """Probe output hook: expand the proven ``[1, ...]`` outputs of the listed calls to the batch."""
    positions = expand.get((id(record.module), record.ordinal))
    if not positions:
        return None
    leaves, spec = tree_flatten(output)
    for j, repeat in positions:
        leaves[j] = leaves[j].expand(batch_size * repeat, *leaves[j].shape[1:])
    return tree_unflatten(leaves, spec)
