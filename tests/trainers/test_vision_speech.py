"""Vision and speech with the three-name change (issue 27 B): every ``*ForImageClassification`` (with
``config.problem_type``), BatchNorm models refused with what to use instead, ``*ForCTC`` (per-example CTC loss),
audio classification, and wav2vec2's SpecAugment (numpy masks), its mask embedding frozen or trainable: exact."""

import copy

import numpy as np
import pytest
import torch
import transformers.models.wav2vec2.modeling_wav2vec2 as wav2vec2_module
from helpers.trainer import check_exact_update, collate, sgd_step_args
from test_tasks import ListDataset
from transformers import (
    ConvNextConfig,
    ConvNextForImageClassification,
    DeiTConfig,
    DeiTForImageClassification,
    ResNetConfig,
    ResNetForImageClassification,
    SwinConfig,
    SwinForImageClassification,
    ViTConfig,
    ViTForImageClassification,
    Wav2Vec2Config,
    Wav2Vec2ForCTC,
    Wav2Vec2ForSequenceClassification,
    XLNetConfig,
    XLNetLMHeadModel,
)

from hf_dp import BookKeepingClipper, DPTrainer
from hf_dp.layers import UnsupportedModuleError
from hf_dp.losses import ctc_loss, infer_loss_type, per_example_loss

IMAGE = 16


def own_loss(model, example):
    """The model's own loss on one example (a batch of one): HF's loss of that head is the per-example loss."""
    return model(**{k: v.unsqueeze(0) for k, v in example.items()}).loss


# ---------------------------------------------------------------------------------------------------------- vision
def vit(**kw):
    cfg = ViTConfig(
        image_size=IMAGE, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw,
    )  # fmt: skip
    return ViTForImageClassification(cfg)


def convnext(**kw):
    cfg = ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=IMAGE, patch_size=4, **kw)
    return ConvNextForImageClassification(cfg)


def image_dataset(n, labels="single", num_labels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        item = {"pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g)}
        if labels == "single":
            item["labels"] = torch.tensor(int(torch.randint(0, num_labels, (1,), generator=g)))
        elif labels == "multi":
            item["labels"] = (torch.rand(num_labels, generator=g) > 0.5).to(torch.get_default_dtype())
        else:  # regression
            item["labels"] = torch.randn(num_labels, generator=g) if num_labels > 1 else torch.randn((), generator=g)
        items.append(item)
    return ListDataset(items)


PROBLEMS = [
    # (problem_type in the config, labels, num_labels, the loss type inferred)
    (None, "single", 3, "sequence_classification"),
    ("single_label_classification", "single", 3, "single_label_classification"),
    ("multi_label_classification", "multi", 3, "multi_label_classification"),
    (None, "multi", 3, "sequence_classification"),  # float labels, several outputs: BCE, as HF decides
    ("regression", "regression", 2, "regression"),
    (None, "regression", 1, "sequence_classification"),  # one output: squared error, as HF decides
]


class TestVision:
    @pytest.mark.parametrize("factory", [vit, convnext], ids=["vit", "convnext"])
    @pytest.mark.parametrize("problem_type,labels,num_labels,loss_type", PROBLEMS)
    def test_image_classification_with_the_three_names(
        self, float64, tmp_dir, factory, problem_type, labels, num_labels, loss_type
    ):
        """``dp_loss_type`` left at "auto": one SGD step equals the clipped float64 per-example oracle (HF's own
        loss of each example alone) for every ``problem_type``."""
        torch.manual_seed(0)
        kw = {"num_labels": num_labels} | ({"problem_type": problem_type} if problem_type else {})
        model = factory(**kw).double()
        trainer = check_exact_update(model, image_dataset(8, labels, num_labels), own_loss, tmp_dir)
        assert trainer.loss_type == loss_type

    @pytest.mark.parametrize(
        "factory",
        [
            lambda: DeiTForImageClassification(
                DeiTConfig(
                    image_size=IMAGE,
                    patch_size=8,
                    hidden_size=16,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    intermediate_size=24,
                )  # fmt: skip
            ),
            lambda: SwinForImageClassification(
                SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=8, depths=[1], num_heads=[2], window_size=2)
            ),
            lambda: vit(problem_type="multi_label_classification"),
            lambda: convnext(problem_type="regression", num_labels=1),
        ],
        ids=["deit", "swin", "vit-multi-label", "convnext-regression"],
    )
    def test_every_image_classifier_gets_its_loss(self, factory):
        model = factory()
        expected = model.config.problem_type or "sequence_classification"
        assert infer_loss_type(model) == expected

    def test_batch_norm_models_are_refused_with_what_to_use(self, tmp_dir):
        model = ResNetForImageClassification(
            ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
        )
        with pytest.raises(UnsupportedModuleError, match="BatchNorm") as err:
            DPTrainer(model=model, args=sgd_step_args(tmp_dir), train_dataset=image_dataset(8), data_collator=collate)
        message = str(err.value)
        assert "GroupNorm" in message and "ModuleValidator.fix" in message and "ViT" in message

    def test_head_losses_are_hf_losses_per_example(self):
        """Each example's loss is HF's batch loss of that example alone; their mean is HF's batch loss."""
        torch.manual_seed(0)
        for problem_type, labels, num_labels, _ in PROBLEMS:
            kw = {"num_labels": num_labels} | ({"problem_type": problem_type} if problem_type else {})
            model = vit(**kw)
            batch = collate([image_dataset(4, labels, num_labels)[i] for i in range(4)])
            ours = per_example_loss(infer_loss_type(model), model(pixel_values=batch["pixel_values"]), batch)
            assert ours.shape == (4,)
            torch.testing.assert_close(ours.mean(), model(**batch).loss)


# ---------------------------------------------------------------------------------------------------------- speech
FRAMES = 200  # samples per example: 23 frames after the tiny feature encoder


def wav2vec2_config(**kw):
    base = dict(
        vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0,
        ctc_loss_reduction="mean", feat_extract_norm="layer", do_stable_layer_norm=True,
    )  # fmt: skip
    return Wav2Vec2Config(**{**base, **kw})


def spec_augment(**kw):
    """SpecAugment on in training (numpy masks of 2 frames, half of the frames), with a trainable mask embedding."""
    return wav2vec2_config(mask_time_prob=0.5, mask_time_length=2, mask_time_min_masks=1, **kw)


def speech_dataset(n, task="ctc", seed=0):
    """Zero-padded audio with an attention mask (variable lengths), CTC targets padded with -100 or a class."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        length = int(torch.randint(120, FRAMES + 1, (1,), generator=g))
        audio = torch.zeros(FRAMES)
        audio[:length] = torch.randn(length, generator=g)
        mask = (torch.arange(FRAMES) < length).long()
        target = int(torch.randint(2, 5, (1,), generator=g))
        labels = torch.full((5,), -100)
        labels[:target] = torch.randint(1, 8, (target,), generator=g)
        if task != "ctc":
            labels = torch.tensor(int(labels[0]) % 3)
        items.append({"input_values": audio, "attention_mask": mask, "labels": labels})
    return ListDataset(items)


def oracle_ctc_loss(model, example):
    """One example's CTC loss in the model's dtype (HF's own computes log-probabilities in float32), divided by
    its target length (``ctc_loss_reduction="mean"``); frames from the attention mask."""
    batch = {k: v.unsqueeze(0) for k, v in example.items()}
    labels = batch.pop("labels")
    logits = model(**batch).logits
    frames = model._get_feat_extract_output_lengths(batch["attention_mask"].sum(-1))
    keep = labels >= 0
    log_probs = torch.log_softmax(logits, -1).transpose(0, 1)
    return torch.nn.functional.ctc_loss(log_probs, labels[keep], frames, keep.sum(-1), blank=0, reduction="mean")


class MaskRecorder:
    """Records SpecAugment's numpy masks (one ``[B, T]`` array per forward pass); ``replaying(row)`` then hands the
    recorded row of one example to a forward pass of that example alone (the oracle of what training computed)."""

    def __init__(self, monkeypatch):
        self.masks, self.row = [], None
        original = wav2vec2_module._compute_mask_indices

        def compute(shape, *args, **kwargs):
            if self.row is not None:
                return self.row.copy()
            mask = original(shape, *args, **kwargs)
            self.masks.append(mask.copy())
            return mask

        monkeypatch.setattr(wav2vec2_module, "_compute_mask_indices", compute)


def per_example_ctc(model, batch):
    outputs = model(input_values=batch["input_values"], attention_mask=batch["attention_mask"])
    return per_example_loss("ctc", outputs, {"labels": batch["labels"]}, model=model, inputs=batch)


class TestSpeech:
    def test_ctc_loss_is_hf_ctc_loss_per_example(self):
        """``mean``: HF's batch loss is the mean of ours; ``sum``: their sum; zero_infinity: an impossible target
        (longer than the frames) gives 0, as HF's."""
        torch.manual_seed(0)
        data = speech_dataset(4)
        batch = collate([data[i] for i in range(4)])
        for reduction, combine in (("mean", torch.mean), ("sum", torch.sum)):
            model = Wav2Vec2ForCTC(wav2vec2_config(ctc_loss_reduction=reduction))
            ours = per_example_ctc(model, batch)
            assert ours.shape == (4,)
            torch.testing.assert_close(combine(ours), model(**batch).loss)
        logits = torch.randn(2, 3, 8)
        labels = torch.tensor([[1, 2, 3, 4], [1, -100, -100, -100]])
        lengths = torch.tensor([3, 3])
        assert torch.isinf(ctc_loss(logits, labels, lengths, zero_infinity=False)[0])
        assert ctc_loss(logits, labels, lengths, zero_infinity=True)[0] == 0

    def test_ctc_needs_the_model(self):
        model = Wav2Vec2ForCTC(wav2vec2_config())
        batch = collate([speech_dataset(2)[i] for i in range(2)])
        outputs = model(input_values=batch["input_values"], attention_mask=batch["attention_mask"])
        with pytest.raises(ValueError, match="needs the model"):
            per_example_loss("ctc", outputs, {"labels": batch["labels"]})

    def test_ctc_with_the_three_names(self, float64, tmp_dir):
        """``Wav2Vec2ForCTC`` picks ``ctc``; one SGD step equals the clipped float64 per-example oracle."""
        torch.manual_seed(0)
        trainer = check_exact_update(
            Wav2Vec2ForCTC(wav2vec2_config()).double(), speech_dataset(8), oracle_ctc_loss, tmp_dir
        )
        assert trainer.loss_type == "ctc"

    def test_audio_classification_with_the_three_names(self, float64, tmp_dir):
        torch.manual_seed(0)
        model = Wav2Vec2ForSequenceClassification(wav2vec2_config(num_labels=3, classifier_proj_size=8)).double()
        trainer = check_exact_update(model, speech_dataset(8, task="classification"), own_loss, tmp_dir)
        assert trainer.loss_type == "sequence_classification"

    @pytest.mark.parametrize("embedding", ["frozen", "trainable"])
    @pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "per-sample", "ghost"])
    @pytest.mark.parametrize("head", ["ctc", "classification"])
    def test_spec_augment_is_exact(self, float64, monkeypatch, mode, head, embedding):
        """SpecAugment in training mode, the masks drawn by the model: norms and clipped sums equal the float64 oracle
        that replays each example's recorded mask (the mask the forward pass applied). Frozen, the mask embedding
        written in place into ``feature_projection``'s output is seen by the hook on its storage root; trainable, it
        is book-kept at the masking call itself (``hf_dp.layers.spec_augment``: no re-run, no redraw)."""
        torch.manual_seed(0)
        model, loss_fn, data = speech_case(head)
        if embedding == "frozen":
            model.wav2vec2.masked_spec_embed.requires_grad_(False)
        model.train()
        batch = collate([data[i] for i in range(4)])
        recorder = MaskRecorder(monkeypatch)
        reference = copy.deepcopy(model)
        named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
        clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
        np.random.seed(0)
        loss = loss_fn(model, batch)
        assert len(recorder.masks) == 1 and recorder.masks[0].any(), "one forward pass, with masked frames"
        grads = []
        for i in range(4):
            recorder.row = recorder.masks[0][i : i + 1]
            loss_i = loss_fn(reference, {k: v[i : i + 1] for k, v in batch.items()})
            grads.append(torch.autograd.grad(loss_i.sum(), [p for _, p in named], allow_unused=True))
        grads = [[torch.zeros_like(p) if g is None else g for g, (_, p) in zip(gi, named, strict=True)] for gi in grads]
        norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
        clipper.max_grad_norm = clip = float(norms.median())  # some examples are clipped, some not
        clipper.backward(loss)
        torch.testing.assert_close(clipper.per_example_norms, norms, rtol=1e-6, atol=0)
        coef = (clip / (norms + 1e-6)).clamp(max=1.0)
        assert (coef < 1).any() and (coef == 1).any(), norms
        params = dict(model.named_parameters())
        scale = float(norms.max())
        for k, (name, _) in enumerate(named):
            expected = sum(coef[i] * grads[i][k] for i in range(4))
            err = float((params[name].grad - expected).norm())
            assert err <= 1e-6 * float(expected.norm()) + 1e-12 * scale, f"{name}: {err:.3e}"
        if embedding == "trainable":
            assert dict(clipper.hooked_modules)["wav2vec2.hf_dp_spec_augment"] == "SpecAugmentRule"
            assert float(params["wav2vec2.masked_spec_embed"].grad.norm()) > 0
        clipper.remove()

    @pytest.mark.parametrize("embedding", ["frozen", "trainable"])
    @pytest.mark.parametrize("head", ["ctc", "classification"])
    def test_spec_augment_through_the_trainer_is_exact(self, float64, tmp_dir, monkeypatch, head, embedding):
        """The three names, SpecAugment on (``run_speech_recognition_ctc.py``, ``run_audio_classification.py``), the
        mask embedding frozen or trainable: one SGD step is the clipped mean of the gradients of the losses training
        computed (each example with the mask its micro-batch drew)."""
        torch.manual_seed(0)
        model, loss_fn, data = speech_case(head, n=8)
        if embedding == "frozen":
            model.wav2vec2.masked_spec_embed.requires_grad_(False)
        recorder = MaskRecorder(monkeypatch)
        order = []

        def recording_collate(features):
            order.append(
                [
                    next(j for j in range(len(data)) if torch.equal(data[j]["input_values"], f["input_values"]))
                    for f in features
                ]
            )
            return collate(features)

        reference = copy.deepcopy(model)
        named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
        clip = TRAINER_CLIP[head]
        args = sgd_step_args(tmp_dir, per_sample_max_grad_norm=clip, per_device_train_batch_size=4)
        trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=recording_collate)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        trainer.train()
        assert trainer.loss_type == ("ctc" if head == "ctc" else "sequence_classification")
        # the training forward passes drew one mask per micro-batch (the last two); before them, the self-check's
        # training-mode passes (engine, reference) on its 2 checked examples drew one mask, from the same restored
        # state (the same mask for both: the check compares like with like)
        assert len(recorder.masks) == 4
        assert recorder.masks[0].shape[0] == 2 and np.array_equal(recorder.masks[0], recorder.masks[1])
        assert all(m.shape[0] == 4 for m in recorder.masks[2:])
        masks = {}
        for rows, mask in zip(order[-2:], recorder.masks[-2:], strict=True):
            masks.update({j: mask[r : r + 1] for r, j in enumerate(rows)})
        assert sorted(masks) == list(range(8))
        reference.train()
        grads = []
        for j in range(8):
            recorder.row = masks[j]
            loss = loss_fn(reference, {k: v.unsqueeze(0) for k, v in data[j].items()})
            grads.append(torch.autograd.grad(loss.sum(), [p for _, p in named], allow_unused=True))
        grads = [[torch.zeros_like(p) if g is None else g for g, (_, p) in zip(gi, named, strict=True)] for gi in grads]
        norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
        assert (norms > clip).any() and (norms < clip).any(), norms
        coef = (clip / (norms + 1e-6)).clamp(max=1.0)
        after = dict(model.named_parameters())
        for k, (name, _) in enumerate(named):
            expected = sum(coef[i] * grads[i][k] for i in range(8)) / 8
            torch.testing.assert_close(after[name].detach() - before[name], -expected, rtol=1e-6, atol=1e-10)
        if embedding == "trainable":
            assert float(after["wav2vec2.masked_spec_embed"].detach().sub(before["wav2vec2.masked_spec_embed"]).norm())


#: The clipping norm of the trainer test: between the smallest and the largest per-example norm of its step.
TRAINER_CLIP = {"ctc": 3.6, "classification": 0.824}


def speech_case(head, n=4):
    """``(model, per-example loss, dataset)`` of a head with SpecAugment on (float64)."""
    if head == "ctc":
        return Wav2Vec2ForCTC(spec_augment()).double(), per_example_ctc, speech_dataset(n)
    model = Wav2Vec2ForSequenceClassification(spec_augment(num_labels=3, classifier_proj_size=8)).double()

    def loss_fn(m, b):
        outputs = m(input_values=b["input_values"], attention_mask=b["attention_mask"])
        return per_example_loss("sequence_classification", outputs, b)

    return model, loss_fn, speech_dataset(n, task="classification")


def test_xlnet_permutation_lm_is_not_inferred_as_causal_lm():
    model = XLNetLMHeadModel(XLNetConfig(vocab_size=16, d_model=8, n_layer=1, n_head=2, d_inner=16))
    with pytest.raises(ValueError, match="permutation language modelling") as err:
        infer_loss_type(model)
    assert "masked_lm" in str(err.value)
