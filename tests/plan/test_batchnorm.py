"""``hf_dp.replace_batchnorm`` (issue 39): BatchNorm models (ResNet; SegFormer, whose decode head has a BatchNorm2d)
converted before training, to GroupNorm (Opacus's conversion: group counts checked against Opacus itself) or to
frozen eval-mode BatchNorm; then the clipper is exact against the float64 per-example oracle, one DPTrainer step is
exactly the clipped mean, and the refusal of an unconverted model names the call."""

import copy
import functools
import logging

import helpers.trainer as trainer_helpers
import pytest
import torch
from helpers.oracle import check_clipper
from helpers.trainer import ListDataset, check_exact_update, collate, sgd_step_args
from opacus.validators import ModuleValidator
from torch import nn
from torch.nn.functional import cross_entropy, interpolate
from torch.nn.modules.batchnorm import _BatchNorm
from transformers import ResNetConfig, ResNetForImageClassification, SegformerConfig, SegformerForSemanticSegmentation

import hf_dp
from hf_dp import DPTrainer, UnsupportedModuleError, replace_batchnorm
from hf_dp.plan.batchnorm import FrozenBatchNorm, default_num_groups

IMAGE = 16
STRATEGIES = ["group_norm", "frozen"]
REPLACEMENT = {"group_norm": nn.GroupNorm, "frozen": FrozenBatchNorm}


def resnet():
    """ResNet (bottleneck layers): eight BatchNorm2d of 2 to 16 channels."""
    return ResNetForImageClassification(
        ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    )


def segformer():
    """SegFormer (no dropout, no stochastic depth): LayerNorm in the encoder, one BatchNorm2d(24) in the decode head."""
    cfg = SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[3, 3],
        strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=24, num_labels=3,
        drop_path_rate=0.0, classifier_dropout_prob=0.0,
    )  # fmt: skip
    return SegformerForSemanticSegmentation(cfg)


def pretrained(factory, seed=0):
    """The model as if pretrained: BatchNorm weights, biases and running statistics away from their initial values
    (three training-mode forward passes), so that copying and freezing them is visible."""
    torch.manual_seed(seed)
    model = factory()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                module.momentum = 0.5
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.5)
        for _ in range(3):
            model(pixel_values=torch.randn(8, 3, IMAGE, IMAGE) * 2 + 0.5)
    return model


def batchnorms(model):
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def segmentation_labels(n, generator):
    return torch.randint(0, 3, (n, IMAGE, IMAGE), generator=generator)


def segmentation_loss(outputs, labels):
    """``[B]``: each example's pixel cross-entropy (logits upsampled to the labels as SegFormer's own loss does),
    averaged over its own labelled pixels."""
    logits = interpolate(outputs.logits, size=labels.shape[-2:], mode="bilinear", align_corners=False)
    per_pixel = cross_entropy(logits, labels, ignore_index=255, reduction="none")
    return per_pixel.flatten(1).sum(1) / (labels != 255).flatten(1).sum(1).clamp(min=1)


def classification_loss(outputs, labels):
    return cross_entropy(outputs.logits, labels, reduction="none")


MODELS = {"resnet": (resnet, classification_loss), "segformer": (segformer, segmentation_loss)}


def batches(name, shapes=(4, 3)):
    g = torch.Generator().manual_seed(1)
    out = []
    for b in shapes:
        labels = segmentation_labels(b, g) if name == "segformer" else torch.randint(0, 3, (b,), generator=g)
        out.append({"pixel_values": torch.randn(b, 3, IMAGE, IMAGE, generator=g), "labels": labels})
    return out


def dataset(name, n=8):
    (batch,) = batches(name, shapes=(n,))
    return ListDataset([{k: v[i] for k, v in batch.items()} for i in range(n)])


def own_loss(model, example):
    """The model's own (HF) loss of one example alone: the oracle's per-example loss."""
    return model(**{k: v.unsqueeze(0) for k, v in example.items()}).loss


# ------------------------------------------------------------------------------------------------ the conversion
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_batchnorm_is_left_and_a_second_call_changes_nothing(name, strategy, caplog):
    model = pretrained(MODELS[name][0])
    found = batchnorms(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert found
    with caplog.at_level(logging.INFO, logger="hf_dp.plan.batchnorm"):
        assert replace_batchnorm(model, strategy=strategy) is model  # in place
    assert batchnorms(model) == []
    assert all(isinstance(model.get_submodule(n), REPLACEMENT[strategy]) for n in found)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable  # weight and bias still train
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"replaced {len(found)} BatchNorm layer(s) (BatchNorm2d: {len(found)})" in line
    modules = list(model.modules())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_dp.plan.batchnorm"):
        replace_batchnorm(model, strategy=strategy)
    assert list(model.modules()) == modules
    assert "replaced 0 BatchNorm" in caplog.records[0].getMessage()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_group_norm_starts_from_the_batchnorm_affine_map(name):
    original = pretrained(MODELS[name][0])
    model = replace_batchnorm(copy.deepcopy(original))
    for layer in batchnorms(original):
        bn, gn = original.get_submodule(layer), model.get_submodule(layer)
        assert (gn.num_channels, gn.num_groups, gn.eps) == (
            bn.num_features,
            default_num_groups(bn.num_features),
            bn.eps,
        )
        assert torch.equal(gn.weight, bn.weight) and torch.equal(gn.bias, bn.bias)
        assert not any(n.startswith("running") for n, _ in gn.named_buffers())  # the running statistics are dropped


@pytest.mark.parametrize("name", sorted(MODELS))
def test_frozen_computes_the_eval_mode_model_in_training_and_never_updates(name):
    original = pretrained(MODELS[name][0])
    model = replace_batchnorm(copy.deepcopy(original), strategy="frozen").train()
    x = torch.randn(4, 3, IMAGE, IMAGE)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    assert torch.equal(model(pixel_values=x).logits, original.eval()(pixel_values=x).logits)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    # BatchNorm's state-dict keys: a saved converted model loads into the original class, and converts back exactly
    assert model.state_dict().keys() == original.state_dict().keys()
    reloaded = MODELS[name][0]()
    reloaded.load_state_dict(model.state_dict())
    replace_batchnorm(reloaded, strategy="frozen")
    assert torch.equal(reloaded(pixel_values=x).logits, model(pixel_values=x).logits)


CHANNELS = [1, 2, 3, 6, 8, 12, 20, 24, 48, 64, 96, 100, 160, 256, 512, 768]


def test_group_counts_are_those_opacus_picks():
    """Opacus's own ``ModuleValidator.fix``, as an independent reference, on BatchNorm1d/2d/3d of many widths and on
    both models."""
    layers = [kind(c) for c in CHANNELS for kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)]
    models = {"layers": nn.Sequential(*layers), "resnet": resnet(), "segformer": segformer()}
    for what, model in models.items():
        opacus = ModuleValidator.fix(copy.deepcopy(model))
        ours = replace_batchnorm(model)
        expected = {n: m.num_groups for n, m in opacus.named_modules() if isinstance(m, nn.GroupNorm)}
        assert {n: m.num_groups for n, m in ours.named_modules() if isinstance(m, nn.GroupNorm)} == expected, what
        assert expected
    assert [default_num_groups(c) for c in (3, 12, 20, 48, 64, 100, 768)] == [1, 4, 4, 16, 32, 4, 32]


# ------------------------------------------------------------------------------------- exact DP on the converted
@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "per-sample", "ghost"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_clipper_matches_the_float64_oracle(float64, name, strategy, mode):
    """Per-example norms and clipped sums of every trainable parameter (the converted layers' weight and bias
    included, on the torch.func fallback) within 1e-6 of the float64 per-example oracle, in every clipping mode."""
    factory, loss = MODELS[name]
    model = replace_batchnorm(pretrained(factory), strategy=strategy)
    clipper = check_clipper(
        model, batches(name), lambda m, b: loss(m(pixel_values=b["pixel_values"]), b["labels"]), mode=mode
    )
    converted = [n for n, m in model.named_modules() if isinstance(m, REPLACEMENT[strategy])]
    assert converted and all(clipper.rules_used[n] == "FallbackRule" for n in converted)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_dp_trainer_step_is_the_clipped_mean(float64, tmp_dir, monkeypatch, name, strategy):
    """sigma = 0, q = 1, SGD lr 1: the update is exactly -(1/N) sum_i clip(g_i), with ``g_i`` HF's own loss of example
    ``i`` alone (SegFormer: no loss is inferred for segmentation, so ``compute_loss_func`` gives the per-pixel mean)."""
    factory, loss = MODELS[name]
    model = replace_batchnorm(pretrained(factory), strategy=strategy).double()
    if name == "segformer":
        monkeypatch.setattr(trainer_helpers, "DPTrainer", functools.partial(DPTrainer, compute_loss_func=loss))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    check_exact_update(model, dataset(name), own_loss, tmp_dir)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())  # frozen statistics stay frozen


# ------------------------------------------------------------------------------------------ refusals and edges
def test_an_unconverted_resnet_is_refused_naming_the_call(tmp_dir):
    with pytest.raises(UnsupportedModuleError, match="is a BatchNorm layer") as err:
        DPTrainer(model=resnet(), args=sgd_step_args(tmp_dir), train_dataset=dataset("resnet"), data_collator=collate)
    message = str(err.value)
    assert "hf_dp.replace_batchnorm(model)" in message and 'strategy="frozen"' in message
    assert "Before training" in message and "ModuleValidator.fix" in message and "ViT" in message
    assert hf_dp.replace_batchnorm is replace_batchnorm and "replace_batchnorm" in hf_dp.__all__


def test_every_batchnorm_kind_shared_layers_and_explicit_groups():
    shared = nn.BatchNorm2d(8)
    model = nn.Sequential(nn.BatchNorm1d(4), shared, nn.Sequential(shared), nn.BatchNorm3d(16), nn.SyncBatchNorm(8))
    replace_batchnorm(model, num_groups=4)
    assert batchnorms(model) == []
    assert [m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)] == [4, 4, 4, 4]
    assert model[1] is model[2][0]  # one layer at two places: one replacement at both
    frozen = replace_batchnorm(nn.Sequential(nn.BatchNorm1d(3, affine=False)), strategy="frozen")
    assert isinstance(frozen[0], FrozenBatchNorm) and list(frozen.parameters()) == []


@pytest.mark.parametrize(
    "model,kwargs,match",
    [
        (
            nn.Sequential(nn.BatchNorm2d(8), nn.BatchNorm2d(6)),
            {"num_groups": 4},
            "does not divide the 6 channels of `1`",
        ),
        (
            nn.Sequential(nn.BatchNorm2d(8), nn.BatchNorm2d(6, track_running_stats=False)),
            {"strategy": "frozen"},
            "no running statistics",
        ),
        (nn.Sequential(nn.BatchNorm2d(8), nn.LazyBatchNorm2d()), {}, "lazy BatchNorm not yet initialised"),
        (nn.Sequential(nn.BatchNorm2d(8)), {"strategy": "instance_norm"}, "strategy must be one of"),
        (nn.Sequential(nn.BatchNorm2d(8)), {"strategy": "frozen", "num_groups": 2}, "for strategy='group_norm' only"),
        (nn.BatchNorm2d(8), {}, "The model itself is a BatchNorm layer"),
    ],
    ids=["groups", "no-statistics", "lazy", "strategy", "groups-frozen", "root"],
)
def test_what_cannot_be_converted_is_refused_and_nothing_is_changed(model, kwargs, match):
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=match):
        replace_batchnorm(model, **kwargs)
    assert [type(m) for m in model.modules()] == before
