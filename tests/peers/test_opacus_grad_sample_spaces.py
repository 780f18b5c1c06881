"""Opacus ``tests/grad_samples`` configuration spaces, as a fixed table, against BookKeepingClipper in float64.

Opacus draws these axes with hypothesis; here each axis value appears in at least one row, every row has two
micro-batches (the clipped sum is accumulated), and ``*-coincide`` rows make sizes equal (micro-batch == sequence
length == a feature size) so that no check can tell dimensions apart by size. Every row is exact, or (where
``refusable`` says so) refused by hf_dp with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from harness import Case, check_config, peer_params
from opacus.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention, SequenceBias
from probes import Probe, floats, ids, layer_case, probe_loss
from torch import nn

NOT_REQUIRED = "not required by issue 17 (Opacus itself asks for a replacement)"
IN_PLACE = "modifies the weight inside the forward pass (refusal is acceptable)"


def _linear() -> dict[str, Case]:
    return {
        "linear-2d": layer_case(lambda: nn.Linear(6, 8), floats((4, 6), (3, 6))),
        "linear-3d": layer_case(lambda: nn.Linear(6, 8), floats((4, 3, 6), (2, 3, 6))),
        "linear-3d-nobias": layer_case(lambda: nn.Linear(6, 8, bias=False), floats((4, 3, 6), (2, 3, 6))),
        "linear-4d": layer_case(lambda: nn.Linear(6, 8), floats((3, 2, 3, 6), (2, 2, 3, 6))),
        "linear-empty-microbatch": layer_case(lambda: nn.Linear(6, 8), floats((4, 3, 6), (0, 3, 6), (3, 3, 6))),
        "linear-coincide": layer_case(lambda: nn.Linear(4, 4), floats((4, 4, 4), (4, 4, 4))),
        "linear-batch-second": layer_case(lambda: nn.Linear(6, 8), floats((3, 4, 6), (3, 2, 6)), batch_dim=1),
        "linear-batch-second-coincide": layer_case(lambda: nn.Linear(4, 5), floats((4, 4, 4), (4, 4, 4)), batch_dim=1),
    }


def _conv() -> dict[str, Case]:
    c1, c2, c3 = nn.Conv1d, nn.Conv2d, nn.Conv3d
    return {
        "conv1d-basic": layer_case(lambda: c1(3, 4, 3), floats((4, 3, 8), (2, 3, 8))),
        "conv1d-stride2-pad2-dil2": layer_case(
            lambda: c1(3, 4, 3, stride=2, padding=2, dilation=2), floats((4, 3, 9), (2, 3, 9))
        ),
        "conv1d-same": layer_case(lambda: c1(3, 4, 4, padding="same", dilation=2), floats((4, 3, 8), (2, 3, 8))),
        "conv1d-valid-nobias": layer_case(
            lambda: c1(3, 4, 2, padding="valid", bias=False), floats((4, 3, 7), (2, 3, 7))
        ),
        "conv1d-groups2": layer_case(lambda: c1(4, 6, 3, groups=2), floats((4, 4, 8), (2, 4, 8))),
        "conv1d-depthwise": layer_case(lambda: c1(4, 4, 3, groups=4, padding=1), floats((4, 4, 8), (2, 4, 8))),
        "conv1d-reflect": layer_case(
            lambda: c1(3, 4, 3, padding=2, padding_mode="reflect"), floats((4, 3, 8), (2, 3, 8))
        ),
        "conv1d-circular": layer_case(
            lambda: c1(3, 4, 3, padding=1, padding_mode="circular"), floats((4, 3, 8), (2, 3, 8))
        ),
        "conv1d-coincide": layer_case(lambda: c1(4, 4, 1), floats((4, 4, 4), (4, 4, 4))),
        "conv2d-basic": layer_case(lambda: c2(3, 4, 2), floats((4, 3, 5, 6), (2, 3, 5, 6))),
        "conv2d-stride2-pad2-dil2": layer_case(
            lambda: c2(3, 2, 2, stride=2, padding=2, dilation=(2, 1)), floats((3, 3, 6, 5), (2, 3, 6, 5))
        ),
        "conv2d-asym-kernel-stride": layer_case(
            lambda: c2(2, 3, (3, 1), stride=(1, 2), dilation=(2, 1)), floats((3, 2, 7, 6), (2, 2, 7, 6))
        ),
        "conv2d-same": layer_case(lambda: c2(3, 4, 3, padding="same"), floats((3, 3, 5, 5), (2, 3, 5, 5))),
        "conv2d-valid": layer_case(lambda: c2(3, 4, 3, padding="valid"), floats((3, 3, 5, 5), (2, 3, 5, 5))),
        "conv2d-groups3": layer_case(lambda: c2(3, 6, 2, groups=3), floats((3, 3, 5, 5), (2, 3, 5, 5))),
        "conv2d-replicate": layer_case(
            lambda: c2(3, 4, 3, padding=1, padding_mode="replicate"), floats((3, 3, 5, 5), (2, 3, 5, 5))
        ),
        "conv2d-empty-microbatch": layer_case(lambda: c2(3, 4, 2), floats((3, 3, 5, 6), (0, 3, 5, 6), (2, 3, 5, 6))),
        "conv2d-coincide": layer_case(lambda: c2(4, 4, 1), floats((4, 4, 4, 4), (4, 4, 4, 4))),
        "conv3d-basic": layer_case(lambda: c3(2, 3, 2), floats((3, 2, 4, 4, 3), (2, 2, 4, 4, 3))),
        "conv3d-stride-pad-dil-groups": layer_case(
            lambda: c3(2, 4, 2, stride=(1, 2, 1), padding=1, dilation=(1, 1, 2), groups=2),
            floats((3, 2, 4, 5, 4), (2, 2, 4, 5, 4)),
        ),
        "conv3d-same-circular": layer_case(
            lambda: c3(2, 3, 3, padding="same", padding_mode="circular"), floats((3, 2, 3, 4, 4), (2, 2, 3, 4, 4))
        ),
    }


def _embedding() -> dict[str, Case]:
    return {
        "embedding-1d": layer_case(lambda: nn.Embedding(11, 5), ids(11, (6,), (4,))),
        "embedding-2d": layer_case(lambda: nn.Embedding(11, 5), ids(11, (4, 6), (3, 6))),
        "embedding-3d": layer_case(lambda: nn.Embedding(11, 5), ids(11, (4, 3, 2), (3, 3, 2))),
        "embedding-4d": layer_case(lambda: nn.Embedding(11, 5), ids(11, (3, 3, 2, 2), (2, 3, 2, 2))),
        "embedding-padding-idx": layer_case(lambda: nn.Embedding(7, 5, padding_idx=0), ids(7, (4, 6), (3, 6))),
        "embedding-padding-idx-negative": layer_case(
            lambda: nn.Embedding(7, 5, padding_idx=-1), ids(7, (4, 6), (3, 6))
        ),
        "embedding-coincide": layer_case(lambda: nn.Embedding(4, 4), ids(4, (4, 4), (4, 4))),
        "embedding-max-norm": layer_case(
            lambda: nn.Embedding(7, 5, max_norm=1.0), ids(7, (4, 6), (3, 6)), refusable=IN_PLACE
        ),
        "embedding-scale-grad-by-freq": layer_case(
            lambda: nn.Embedding(7, 5, scale_grad_by_freq=True),
            ids(7, (4, 6), (3, 6)),
            refusable="the gradient scale depends on the whole batch (refusal is acceptable)",
        ),
    }


def _bags(sizes: list[list[int]], vocab: int, *, weights: bool = False, seed: int = 0):
    """EmbeddingBag micro-batches: flat ids and ``offsets`` (one bag per example), optional per-sample weights."""

    def make() -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for bag_sizes in sizes:
            n = sum(bag_sizes)
            offsets = torch.tensor([0, *torch.tensor(bag_sizes).cumsum(0).tolist()[:-1]])
            kw = {"offsets": offsets}
            if weights:
                kw["per_sample_weights"] = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
            out.append({"x": torch.randint(0, vocab, (n,), generator=g), "kw": kw})
        return out

    return make


def _bag_case(make_layer, batches) -> Case:
    return Case(build=lambda: Probe(make_layer()), batches=batches, loss_fn=probe_loss())


def _embedding_bag() -> dict[str, Case]:
    sizes = [[3, 1, 4, 2], [2, 5, 1]]
    return {
        "embbag-2d-sum": layer_case(lambda: nn.EmbeddingBag(9, 5, mode="sum"), ids(9, (4, 3), (3, 3))),
        "embbag-2d-mean": layer_case(lambda: nn.EmbeddingBag(9, 5, mode="mean"), ids(9, (4, 3), (3, 3))),
        "embbag-2d-max": layer_case(lambda: nn.EmbeddingBag(9, 5, mode="max"), ids(9, (4, 3), (3, 3))),
        "embbag-offsets-sum": _bag_case(lambda: nn.EmbeddingBag(9, 5, mode="sum"), _bags(sizes, 9)),
        "embbag-offsets-mean": _bag_case(lambda: nn.EmbeddingBag(9, 5, mode="mean"), _bags(sizes, 9)),
        "embbag-offsets-max": _bag_case(lambda: nn.EmbeddingBag(9, 5, mode="max"), _bags(sizes, 9)),
        "embbag-offsets-weights": _bag_case(lambda: nn.EmbeddingBag(9, 5, mode="sum"), _bags(sizes, 9, weights=True)),
        "embbag-offsets-padding-idx": _bag_case(
            lambda: nn.EmbeddingBag(6, 5, mode="sum", padding_idx=0), _bags(sizes, 6)
        ),
        # every bag holds one id but one, and one is empty: the flat input has as many ids as there are bags
        "embbag-offsets-coincide": _bag_case(
            lambda: nn.EmbeddingBag(9, 5, mode="sum"), _bags([[2, 0, 1, 1], [1, 2, 1, 0]], 9)
        ),
    }


def _norms() -> dict[str, Case]:
    lin = lambda d: lambda: nn.Linear(d, d)  # noqa: E731  (a trainable layer before a norm without parameters)
    return {
        "layernorm-1d-of-2d": layer_case(lambda: nn.LayerNorm(6), floats((4, 6), (3, 6))),
        "layernorm-1d-of-4d": layer_case(lambda: nn.LayerNorm(6), floats((3, 2, 3, 6), (2, 2, 3, 6))),
        "layernorm-2d-of-3d": layer_case(lambda: nn.LayerNorm([3, 6]), floats((4, 3, 6), (3, 3, 6))),
        "layernorm-3d-of-4d": layer_case(lambda: nn.LayerNorm([2, 3, 6]), floats((3, 2, 3, 6), (2, 2, 3, 6))),
        "layernorm-nobias": layer_case(lambda: nn.LayerNorm(6, bias=False), floats((4, 3, 6), (3, 3, 6))),
        "layernorm-no-affine": layer_case(
            lambda: nn.LayerNorm(6, elementwise_affine=False), floats((4, 3, 6), (3, 3, 6)), pre=lin(6)
        ),
        "layernorm-coincide": layer_case(lambda: nn.LayerNorm(4), floats((4, 4, 4), (4, 4, 4))),
        "groupnorm-1group": layer_case(lambda: nn.GroupNorm(1, 4), floats((4, 4, 3, 2), (3, 4, 3, 2))),
        "groupnorm-2groups": layer_case(lambda: nn.GroupNorm(2, 4), floats((4, 4, 5), (3, 4, 5))),
        "groupnorm-c-groups": layer_case(lambda: nn.GroupNorm(4, 4), floats((4, 4, 3, 2), (3, 4, 3, 2))),
        "groupnorm-no-affine": layer_case(
            lambda: nn.GroupNorm(2, 4, affine=False), floats((4, 4, 3), (3, 4, 3)), pre=lin(3)
        ),
        "groupnorm-coincide": layer_case(lambda: nn.GroupNorm(2, 4), floats((4, 4, 4), (4, 4, 4))),
        "instancenorm1d-affine": layer_case(lambda: nn.InstanceNorm1d(3, affine=True), floats((4, 3, 5), (3, 3, 5))),
        "instancenorm2d-affine": layer_case(
            lambda: nn.InstanceNorm2d(3, affine=True), floats((4, 3, 4, 3), (3, 3, 4, 3))
        ),
        "instancenorm3d-affine": layer_case(
            lambda: nn.InstanceNorm3d(2, affine=True), floats((3, 2, 3, 3, 2), (2, 2, 3, 3, 2))
        ),
        "instancenorm1d-affine-running-stats": layer_case(
            lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
            floats((4, 3, 5), (3, 3, 5)),
            refusable="updates running statistics inside the forward pass (refusal is acceptable)",
        ),
        "instancenorm1d-no-affine": layer_case(
            lambda: nn.Sequential(nn.Conv1d(3, 3, 1), nn.InstanceNorm1d(3)), floats((4, 3, 5), (3, 3, 5))
        ),
        "instancenorm1d-coincide": layer_case(lambda: nn.InstanceNorm1d(4, affine=True), floats((4, 4, 4), (4, 4, 4))),
        "rmsnorm-1d-of-3d": layer_case(lambda: nn.RMSNorm(6), floats((4, 3, 6), (3, 3, 6))),
        "rmsnorm-2d-of-3d": layer_case(lambda: nn.RMSNorm([3, 6]), floats((4, 3, 6), (3, 3, 6))),
        "rmsnorm-3d-of-4d": layer_case(lambda: nn.RMSNorm([2, 3, 6], eps=1e-5), floats((3, 2, 3, 6), (2, 2, 3, 6))),
        "rmsnorm-coincide": layer_case(lambda: nn.RMSNorm(4), floats((4, 4, 4), (4, 4, 4))),
        "batchnorm1d": layer_case(
            lambda: nn.BatchNorm1d(4),
            floats((4, 4, 3), (3, 4, 3)),
            refusable="BatchNorm mixes examples (must be refused)",
        ),
    }


def _rnn(cls, *, batch_first=True, layers=1, bidirectional=False, bias=True, shapes=((3, 4, 5), (2, 4, 5))):
    return layer_case(
        lambda: cls(5, 6, num_layers=layers, batch_first=batch_first, bidirectional=bidirectional, bias=bias),
        floats(*shapes),
        batch_dim=0 if batch_first else 1,
    )


def _packed(lengths_per_batch: list[list[int]], d: int, seed: int = 0):
    """PackedSequence micro-batches (batch-first padded input, unsorted lengths)."""

    def make() -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for lengths in lengths_per_batch:
            x = torch.randn(len(lengths), max(lengths), d, generator=g, dtype=torch.float64)
            packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
            out.append({"x": packed})
        return out

    return make


def _recurrent() -> dict[str, Case]:
    return {
        "dprnn-1layer": _rnn(DPRNN),
        "dprnn-2layers-bidirectional": _rnn(DPRNN, layers=2, bidirectional=True),
        "dpgru-nobias": _rnn(DPGRU, bias=False),
        "dpgru-bidirectional": _rnn(DPGRU, bidirectional=True),
        "dplstm-1layer": _rnn(DPLSTM),
        "dplstm-2layers": _rnn(DPLSTM, layers=2),
        "dplstm-coincide": _rnn(DPLSTM, shapes=((4, 4, 5), (4, 4, 5))),
        "dplstm-batch-second": _rnn(DPLSTM, batch_first=False, shapes=((4, 3, 5), (4, 2, 5))),
        "dplstm-batch-second-coincide": _rnn(DPLSTM, batch_first=False, shapes=((4, 4, 5), (4, 4, 5))),
        "dplstm-packed": Case(
            build=lambda: Probe(DPLSTM(5, 6, batch_first=True)),
            batches=_packed([[4, 2, 3], [1, 4]], 5),
            loss_fn=probe_loss(),
            refusable="PackedSequence inputs: refused at the first batch (pad the sequences instead)",
        ),
        "torch-lstm": layer_case(
            lambda: nn.LSTM(5, 6, batch_first=True), floats((3, 4, 5), (2, 4, 5)), refusable=NOT_REQUIRED
        ),
        "torch-gru-2layers": layer_case(
            lambda: nn.GRU(5, 6, num_layers=2, batch_first=True), floats((3, 4, 5), (2, 4, 5)), refusable=NOT_REQUIRED
        ),
        "torch-rnn": layer_case(
            lambda: nn.RNN(5, 6, batch_first=True), floats((3, 4, 5), (2, 4, 5)), refusable=NOT_REQUIRED
        ),
    }


class _QKV(nn.Module):
    """Attention as a one-input layer: q, k, v stacked on the last dimension (as Opacus's adapter does)."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x):
        q, k, v = x.unbind(-1)
        return self.attn(q, k, v)[0]


def _attention_case(cls, *, batch_first: bool, shapes, **kw) -> Case:
    return layer_case(
        lambda: _QKV(cls(4, 2, batch_first=batch_first, **kw)), floats(*shapes), batch_dim=0 if batch_first else 1
    )


def _attention() -> dict[str, Case]:
    bf = ((3, 5, 4, 3), (2, 5, 4, 3))  # [B, T, d, (q, k, v)]
    bs = ((5, 3, 4, 3), (5, 2, 4, 3))  # [T, B, d, (q, k, v)]
    same = ((4, 4, 4, 3), (4, 4, 4, 3))
    cases = {}
    for name, cls in (("dpmha", DPMultiheadAttention), ("torch-mha", nn.MultiheadAttention)):
        cases[f"{name}-batch-first"] = _attention_case(cls, batch_first=True, shapes=bf)
        cases[f"{name}-nobias"] = _attention_case(cls, batch_first=True, shapes=bf, bias=False)
        cases[f"{name}-bias-kv-zero-attn"] = _attention_case(
            cls, batch_first=True, shapes=bf, add_bias_kv=True, add_zero_attn=True
        )
        cases[f"{name}-kdim-vdim"] = _attention_case(cls, batch_first=True, shapes=bf, kdim=4, vdim=4)
        cases[f"{name}-coincide"] = _attention_case(cls, batch_first=True, shapes=same)
        cases[f"{name}-batch-second"] = _attention_case(cls, batch_first=False, shapes=bs)
        cases[f"{name}-batch-second-coincide"] = _attention_case(cls, batch_first=False, shapes=same)
    return cases


def _sequence_bias() -> dict[str, Case]:
    return {
        "sequence-bias-batch-first": layer_case(
            lambda: SequenceBias(4, batch_first=True), floats((3, 5, 4), (2, 5, 4))
        ),
        "sequence-bias-batch-second": layer_case(lambda: SequenceBias(4), floats((5, 3, 4), (5, 2, 4)), batch_dim=1),
        "sequence-bias-batch-second-coincide": layer_case(
            lambda: SequenceBias(4), floats((3, 4, 4), (3, 4, 4)), batch_dim=1
        ),
        "sequence-bias-as-root": Case(
            build=lambda: SequenceBias(4, batch_first=True),
            batches=floats((3, 5, 4), (2, 5, 4)),
            loss_fn=probe_loss(),
        ),
    }


CONFIGS: dict[str, Case] = {
    **_linear(),
    **_conv(),
    **_embedding(),
    **_embedding_bag(),
    **_norms(),
    **_recurrent(),
    **_attention(),
    **_sequence_bias(),
}


@pytest.mark.parametrize(("config_id", "mode"), peer_params(CONFIGS))
def test_opacus_configuration(config_id, mode):
    check_config(config_id, CONFIGS[config_id], mode)
