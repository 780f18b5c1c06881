"""``nn.EmbeddingBag`` with a flat 1-D input and ``offsets`` (example ``i`` owns bag ``i``), as the root model and
inside a model, against the float64 oracle in every clipping mode; and the refusals where the inputs are no bags."""

import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn

from hf_dp import BookKeepingClipper, UnsupportedModuleError

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]
#: Bag sizes of each micro-batch: empty bags, a micro-batch of one bag, micro-batches of several.
SIZES = ([3, 0, 4, 2], [2], [1, 5, 0], [2, 3])


def flat_bags(sizes: list[int], vocab: int, *, include_last: bool = False, seed: int = 0):
    """``(ids, offsets)`` of bags of ``sizes`` ids (ids below ``vocab``, 0 among them)."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.tensor(sizes, dtype=torch.long).cumsum(0).tolist()
    offsets = torch.tensor([0, *ends] if include_last else [0, *ends[:-1]], dtype=torch.long)
    return torch.randint(0, vocab, (sum(sizes),), generator=g), offsets


def loss_of(y: torch.Tensor) -> torch.Tensor:
    """A per-example loss of ``[B, d]`` outputs whose gradient differs between examples."""
    return (y**2).sum(1) + y.sum(1)


def micro_batches(vocab=9, *, include_last=False, weights=False):
    out = []
    for k, sizes in enumerate(SIZES):
        ids, offsets = flat_bags(sizes, vocab, include_last=include_last, seed=k)
        batch = {"input": ids, "offsets": offsets}
        if weights:
            batch["per_sample_weights"] = torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(k)) + 0.5
        out.append(batch)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("include_last", [False, True])
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_root_embedding_bag_with_offsets(float64, mode, include_last, reduce):
    """The root model, called positionally: padding ids, empty bags, micro-batches of one and several bags."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(9, 5, mode=reduce, padding_idx=0, include_last_offset=include_last)
    batches = micro_batches(include_last=include_last)
    clipper = check_clipper(bag, batches, lambda m, b: loss_of(m(b["input"], b["offsets"])), mode=mode)
    assert clipper.rules_used[""] == "EmbeddingBagRule"


@pytest.mark.parametrize("mode", MODES)
def test_root_positional_per_sample_weights(float64, mode):
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(9, 5, mode="sum")
    batches = [tuple(b.values()) for b in micro_batches(weights=True)]
    check_clipper(bag, [{"x": b} for b in batches], lambda m, b: loss_of(m(*b["x"])), mode=mode)


class ModelWithLoss(nn.Module):
    """Opacus's test wrapper (``opacus.utils.per_sample_gradients_utils``): ``x`` is the tuple ``(input, offsets)``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.wrapped_module = module

    def forward(self, x):
        return self.wrapped_module(*x) if type(x) is tuple else self.wrapped_module(x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("include_last", [False, True])
def test_inner_embedding_bag_fed_by_the_root_inputs(float64, mode, include_last):
    """An inner EmbeddingBag that takes the root's inputs as they are, in a tuple (Opacus's grad-sample tests)."""
    torch.manual_seed(0)
    model = ModelWithLoss(nn.EmbeddingBag(9, 5, mode="mean", include_last_offset=include_last))
    batches = [{"x": (b["input"], b["offsets"])} for b in micro_batches(include_last=include_last)]
    check_clipper(model, batches, lambda m, b: loss_of(m(b["x"])), mode=mode)


class Padded(nn.Module):
    """Padded ``[B, L]`` ids and lengths in; the flat input and offsets of an inner EmbeddingBag built inside."""

    def __init__(self, reduce: str = "sum", include_last: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 5, mode=reduce, padding_idx=0, include_last_offset=include_last)
        self.head = nn.Linear(5, 3)

    def forward(self, ids, lengths):
        flat = ids[torch.arange(ids.shape[1]) < lengths[:, None]]
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        bags = self.bag(flat, offsets if self.bag.include_last_offset else offsets[:-1])
        return self.head(torch.tanh(bags))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("include_last", [False, True])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_inner_embedding_bag_with_offsets_built_inside(float64, mode, include_last, reduce):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [
        {"ids": torch.randint(0, 9, (len(sizes), 5), generator=g), "lengths": torch.tensor(sizes)}
        for sizes in ([3, 0, 4, 2], [2], [1, 5, 0])
    ]
    model = Padded(reduce, include_last)
    check_clipper(model, batches, lambda m, b: loss_of(m(b["ids"], b["lengths"])), mode=mode)


class TwoFeatures(nn.Module):
    """A recommendation-style model: two sparse features (ids and offsets each, the second hashed) and a head."""

    def __init__(self, last_a: bool, last_b: bool) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(9, 4, mode="sum", include_last_offset=last_a)
        self.b = nn.EmbeddingBag(7, 4, mode="mean", include_last_offset=last_b)
        self.head = nn.Linear(8, 2)

    def forward(self, ids_a, offsets_a, ids_b, offsets_b):
        return self.head(torch.tanh(torch.cat([self.a(ids_a, offsets_a), self.b(ids_b % 7, offsets_b)], 1)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("last", [(False, False), (True, True), (False, True)])
def test_two_features_of_a_recommendation_model(float64, mode, last):
    torch.manual_seed(0)
    batches = []
    for k, sizes in enumerate(SIZES):
        a = flat_bags(sizes, 9, include_last=last[0], seed=k)
        b = flat_bags([s + 1 for s in sizes], 20, include_last=last[1], seed=k + 10)
        batches.append({"x": (*a, *b)})
    check_clipper(TwoFeatures(*last), batches, lambda m, b: loss_of(m(*b["x"])), mode=mode)


def test_self_check_cuts_bags(float64):
    torch.manual_seed(0)
    model = ModelWithLoss(nn.EmbeddingBag(9, 5, mode="sum"))
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    batch = micro_batches()[0]
    error = clipper.self_check({"x": (batch["input"], batch["offsets"])}, lambda m, b: loss_of(m(b["x"])))
    assert error < 1e-9


class Lengths(nn.Module):
    """Takes lengths, not offsets, next to the flat ids."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 5)

    def forward(self, ids, lengths):
        return self.bag(ids, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]]))


class NoBags(nn.Module):
    """Two 1-D integer inputs that an EmbeddingBag takes as a batch-first ``[B, 1]`` input, not as bags."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 5)

    def forward(self, ids, other):
        return self.bag((ids + other).unsqueeze(1))


@pytest.mark.parametrize(
    ("model", "inputs", "match"),
    [
        (Lengths(), (torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 1, 3])), "these are no offsets"),
        (NoBags(), (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])), "no nn.EmbeddingBag of the model takes"),
        (TwoFeatures(False, False), (*flat_bags([1, 2], 9), *flat_bags([1, 2, 3], 7)), "different numbers of bags"),
    ],
)
def test_inputs_that_are_no_bags_are_refused(float64, model, inputs, match):
    clipper = BookKeepingClipper(model.double(), max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=match):
        clipper.backward(loss_of(model(*inputs)))
    clipper.remove()
