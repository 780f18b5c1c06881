"""fastDP's supported-layer list (``supported_layers_grad_samplers``) against BookKeepingClipper in float64.

fastDP covers nn.Linear, nn.Conv1d/2d/3d, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d/2d/3d,
transformers ``Conv1D`` and T5's ``T5LayerNorm``, in full fine-tuning and in bias-only fine-tuning (BiTFiT: weights
frozen), with a per-layer choice between ghost norm and instantiation (BK-MixOpt: ghost when ``2T^2 <= p*d``). Each
row here takes one layer (or a small stack of them) at sequence-model shapes, on both sides of that choice, with a
row where micro-batch == sequence length == a feature size.
"""

from __future__ import annotations

import pytest
from harness import Case, check_config, peer_params
from probes import floats, ids, layer_case
from torch import nn
from transformers.models.t5.modeling_t5 import T5LayerNorm
from transformers.pytorch_utils import Conv1D


def bias_only(make_layer):
    """BiTFiT: the layer with every parameter but the biases frozen."""

    def make() -> nn.Module:
        layer = make_layer()
        for name, p in layer.named_parameters():
            p.requires_grad_(name.endswith("bias"))
        return layer

    return make


class _Stack(nn.Module):
    """Embedding -> LayerNorm -> Linear -> GELU -> HF Conv1D -> T5LayerNorm: every fastDP layer type in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(13, 8, padding_idx=0)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 12)
        self.proj = Conv1D(8, 12)
        self.norm = T5LayerNorm(8)

    def forward(self, x):
        return self.norm(self.proj(nn.functional.gelu(self.fc(self.ln(self.wte(x))))))


class _ConvNet(nn.Module):
    """Conv2d -> GroupNorm -> Conv2d(groups) -> InstanceNorm2d(affine): a small fastDP vision stack."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 2, stride=2, groups=2)
        self.inorm = nn.InstanceNorm2d(4, affine=True)

    def forward(self, x):
        return self.inorm(self.conv2(nn.functional.relu(self.gn(self.conv1(x)))))


CONFIGS: dict[str, Case] = {
    "linear-seq": layer_case(lambda: nn.Linear(6, 5), floats((4, 5, 6), (3, 5, 6))),
    "linear-mixopt-instantiate": layer_case(lambda: nn.Linear(2, 3), floats((4, 8, 2), (3, 8, 2))),  # 2T^2 > pd
    "linear-mixopt-ghost": layer_case(lambda: nn.Linear(8, 8), floats((4, 2, 8), (3, 2, 8))),  # 2T^2 < pd
    "linear-bias-only": layer_case(bias_only(lambda: nn.Linear(6, 5)), floats((4, 5, 6), (3, 5, 6))),
    "linear-seq-coincide": layer_case(lambda: nn.Linear(5, 5), floats((5, 5, 5), (5, 5, 5))),
    "hf-conv1d-seq": layer_case(lambda: Conv1D(5, 6), floats((4, 5, 6), (3, 5, 6))),
    "hf-conv1d-2d": layer_case(lambda: Conv1D(5, 6), floats((4, 6), (3, 6))),
    "hf-conv1d-mixopt-instantiate": layer_case(lambda: Conv1D(3, 2), floats((4, 8, 2), (3, 8, 2))),
    "hf-conv1d-bias-only": layer_case(bias_only(lambda: Conv1D(5, 6)), floats((4, 5, 6), (3, 5, 6))),
    "hf-conv1d-coincide": layer_case(lambda: Conv1D(5, 5), floats((5, 5, 5), (5, 5, 5))),
    "embedding-seq": layer_case(lambda: nn.Embedding(9, 6), ids(9, (4, 5), (3, 5))),
    "embedding-seq-padding-idx": layer_case(lambda: nn.Embedding(9, 6, padding_idx=0), ids(9, (4, 5), (3, 5))),
    "embedding-seq-coincide": layer_case(lambda: nn.Embedding(5, 5, padding_idx=1), ids(5, (5, 5), (5, 5))),
    "layernorm-seq": layer_case(lambda: nn.LayerNorm(6), floats((4, 5, 6), (3, 5, 6))),
    "layernorm-bias-only": layer_case(bias_only(lambda: nn.LayerNorm(6)), floats((4, 5, 6), (3, 5, 6))),
    "layernorm-seq-coincide": layer_case(lambda: nn.LayerNorm(5), floats((5, 5, 5), (5, 5, 5))),
    "t5-layernorm-seq": layer_case(lambda: T5LayerNorm(6), floats((4, 5, 6), (3, 5, 6))),
    "t5-layernorm-coincide": layer_case(lambda: T5LayerNorm(5), floats((5, 5, 5), (5, 5, 5))),
    "conv1d": layer_case(lambda: nn.Conv1d(3, 4, 3, padding=1), floats((4, 3, 6), (3, 3, 6))),
    "conv1d-mixopt-instantiate": layer_case(lambda: nn.Conv1d(2, 2, 1), floats((4, 2, 8), (3, 2, 8))),
    "conv1d-bias-only": layer_case(bias_only(lambda: nn.Conv1d(3, 4, 3)), floats((4, 3, 6), (3, 3, 6))),
    "conv2d": layer_case(lambda: nn.Conv2d(3, 4, 2, stride=2), floats((4, 3, 4, 4), (3, 3, 4, 4))),
    "conv2d-bias-only": layer_case(bias_only(lambda: nn.Conv2d(3, 4, 3)), floats((4, 3, 4, 4), (3, 3, 4, 4))),
    "conv2d-1x1-coincide": layer_case(lambda: nn.Conv2d(4, 4, 1), floats((4, 4, 2, 2), (4, 4, 2, 2))),
    "conv3d": layer_case(lambda: nn.Conv3d(2, 3, 2), floats((3, 2, 3, 3, 3), (2, 2, 3, 3, 3))),
    "conv3d-bias-only": layer_case(bias_only(lambda: nn.Conv3d(2, 3, 2)), floats((3, 2, 3, 3, 3), (2, 2, 3, 3, 3))),
    "groupnorm": layer_case(lambda: nn.GroupNorm(2, 4), floats((4, 4, 5), (3, 4, 5))),
    "groupnorm-bias-only": layer_case(bias_only(lambda: nn.GroupNorm(2, 4)), floats((4, 4, 5), (3, 4, 5))),
    "instancenorm1d": layer_case(lambda: nn.InstanceNorm1d(4, affine=True), floats((4, 4, 5), (3, 4, 5))),
    "instancenorm2d": layer_case(lambda: nn.InstanceNorm2d(3, affine=True), floats((4, 3, 3, 3), (3, 3, 3, 3))),
    "instancenorm3d": layer_case(lambda: nn.InstanceNorm3d(2, affine=True), floats((3, 2, 2, 3, 2), (2, 2, 2, 3, 2))),
    "instancenorm2d-bias-only": layer_case(
        bias_only(lambda: nn.InstanceNorm2d(3, affine=True)), floats((4, 3, 3, 3), (3, 3, 3, 3))
    ),
    "stack-text": layer_case(_Stack, ids(13, (4, 6), (3, 6))),
    "stack-text-coincide": layer_case(_Stack, ids(13, (8, 8), (8, 8))),
    "stack-text-bias-only": layer_case(bias_only(_Stack), ids(13, (4, 6), (3, 6))),
    "stack-vision": layer_case(_ConvNet, floats((4, 3, 4, 4), (3, 3, 4, 4))),
}


@pytest.mark.parametrize(("config_id", "mode"), peer_params(CONFIGS))
def test_fastdp_layer(config_id, mode):
    check_config(config_id, CONFIGS[config_id], mode)
