"""SpecAugment's trainable mask embedding (``masked_spec_embed``), book-kept at the masking call
(:mod:`hf_dp.layers.spec_augment`): exact against the float64 oracle in every mode, with the mask passed as
``mask_time_indices`` or drawn by the model (numpy seeded alike for the oracle and the engine), time and feature masks;
the same for every model family that shares wav2vec2's ``_mask_hidden_states``; any other use of the embedding
refused; the model plain again after ``remove()``."""

import copy

import numpy as np
import pytest
import torch
import transformers
from helpers.oracle import check_clipper
from torch import nn

from hf_dp import BookKeepingClipper
from hf_dp.layers import UnsupportedModuleError
from hf_dp.layers.spec_augment import CHILD, SpecAugmentMask
from hf_dp.losses import per_example_loss

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]
SAMPLES = 200  # audio samples per example: 23 frames after the tiny feature encoder
FRAMES = 23
NO_DROPOUT = dict(
    hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
    layerdrop=0.0,
)  # fmt: skip
SPEC_AUGMENT = dict(
    mask_time_prob=0.5, mask_time_length=2, mask_time_min_masks=1, mask_feature_prob=0.3, mask_feature_length=2
)
TINY = dict(
    vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, pad_token_id=0
)
CONV = dict(
    conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2
)


def wav2vec2(head, **kw):
    config = transformers.Wav2Vec2Config(
        **TINY, **CONV, **NO_DROPOUT, **{**SPEC_AUGMENT, **kw}, num_labels=3, classifier_proj_size=8,
        feat_extract_norm="layer", do_stable_layer_norm=True,
    )  # fmt: skip
    cls = transformers.Wav2Vec2ForCTC if head == "ctc" else transformers.Wav2Vec2ForSequenceClassification
    return cls(config)


def audio_batch(n=4, seed=0, head="ctc", mask=False):
    """Zero-padded audio with an attention mask, CTC targets (padded with -100) or a class; ``mask``: a
    ``mask_time_indices`` of whole frames (every example with some masked frames)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(120, SAMPLES + 1, (n,), generator=g)
    attention = (torch.arange(SAMPLES)[None] < lengths[:, None]).long()
    batch = {"input_values": torch.randn(n, SAMPLES, generator=g) * attention, "attention_mask": attention}
    if head == "ctc":
        labels = torch.randint(1, 8, (n, 4), generator=g)
        labels[0, 3:] = -100
    else:
        labels = torch.randint(0, 3, (n,), generator=g)
    batch["labels"] = labels
    if mask:
        batch["mask_time_indices"] = torch.rand(n, FRAMES, generator=g) < 0.4
        batch["mask_time_indices"][:, 0] = True
    return batch


def speech_loss(loss_type, seed=None):
    """``(model, batch) -> [B]`` losses of the model's outputs; ``seed``: numpy and torch seeded first, so that the
    oracle's forward pass and the engine's draw the same masks."""

    def loss_fn(model, batch):
        if seed is not None:
            np.random.seed(seed)
            torch.manual_seed(seed)
        inputs = {k: v for k, v in batch.items() if k != "labels" or loss_type == "seq2seq_lm"}
        return per_example_loss(loss_type, model(**inputs), batch, model=model, inputs=batch)

    return loss_fn


def assert_embedding_book_kept(clipper, model):
    """The embedding was covered at the masking call (no fallback re-run) and got a gradient."""
    rules = clipper.rules_used
    assert rules[f"{model.base_model_prefix}.{CHILD}"] == "SpecAugmentRule", rules
    assert model.base_model_prefix not in rules  # the model itself is not re-run per example
    assert float(model.base_model.masked_spec_embed.grad.norm()) > 0


# ------------------------------------------------------------------------------------------------------- wav2vec2
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head", ["ctc", "classification"])
def test_wav2vec2_masks_drawn_in_training(float64, mode, head):
    """Training mode: the model draws its time and feature masks from numpy in every forward pass (seeded alike for
    the oracle and the engine); the embedding's gradient is the output gradient summed over its masked frames, with
    the masked features (written 0 after it) left out."""
    torch.manual_seed(0)
    model = wav2vec2(head).train()
    loss_type = "ctc" if head == "ctc" else "sequence_classification"
    batches = [audio_batch(head=head), audio_batch(seed=1, head=head)]
    clipper = check_clipper(model, batches, speech_loss(loss_type, seed=0), mode=mode)
    assert_embedding_book_kept(clipper, model)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head", ["ctc", "classification"])
def test_wav2vec2_mask_passed_as_input(float64, mode, head):
    """``mask_time_indices`` passed to the model (in eval mode too the embedding is written: the plan's probe sees
    the use, and the rule is checked against autograd on it)."""
    torch.manual_seed(0)
    model = wav2vec2(head).eval()
    loss_type = "ctc" if head == "ctc" else "sequence_classification"
    batches = [audio_batch(head=head, mask=True), audio_batch(seed=1, head=head, mask=True)]
    clipper = check_clipper(model, batches, speech_loss(loss_type), mode=mode)
    assert_embedding_book_kept(clipper, model)


def test_the_engine_uses_the_mask_the_forward_pass_drew(float64, monkeypatch):
    """The engine's forward pass draws its own mask (numpy not seeded): its norms and clipped sums are those of the
    oracle given that mask as ``mask_time_indices``, and the engine draws nothing more from numpy."""
    import transformers.models.wav2vec2.modeling_wav2vec2 as modeling

    torch.manual_seed(0)
    model = wav2vec2("ctc", mask_feature_prob=0.0).train()
    reference = copy.deepcopy(model)
    drawn = []
    original = modeling._compute_mask_indices

    def compute(*args, **kwargs):
        drawn.append(original(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(modeling, "_compute_mask_indices", compute)
    batch = audio_batch()
    clipper = BookKeepingClipper(model, max_grad_norm=1e6, mode="bk-mixopt")  # nothing clipped: the plain sum
    np.random.seed(12345)
    loss = speech_loss("ctc")(model, batch)
    state = np.random.get_state()
    clipper.backward(loss)
    assert len(drawn) == 1 and drawn[0].any()
    assert np.array_equal(np.random.get_state()[1], state[1]), "the engine drew from numpy"
    given = {**batch, "mask_time_indices": torch.tensor(drawn[0])}
    oracle = speech_loss("ctc")(reference, given)
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    grads = [torch.autograd.grad(oracle[i], [p for _, p in named], retain_graph=True) for i in range(len(oracle))]
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
    torch.testing.assert_close(clipper.per_example_norms, norms, rtol=1e-6, atol=0)
    params = dict(model.named_parameters())
    for k, (name, _) in enumerate(named):
        torch.testing.assert_close(params[name].grad, sum(g[k] for g in grads), rtol=1e-6, atol=1e-12)
    clipper.remove()


# ------------------------------------------------------------------------------------------------------- families
def _features_batch(head):
    """Wav2Vec2-BERT takes log-mel features ``[B, T, 8]``."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[0, 9:] = 0
    labels = torch.randint(1, 8, (4, 3), generator=g)
    return {"input_features": torch.randn(4, 12, 8, generator=g), "attention_mask": mask, "labels": labels}


FAMILIES = {
    "hubert": ("HubertConfig", "HubertForCTC", dict(feat_extract_norm="layer", do_stable_layer_norm=True)),
    # WavLM's `_mask_hidden_states` reads `config.mask_feature_min_masks`, which its config lacks: time masks only
    "wavlm": (
        "WavLMConfig",
        "WavLMForCTC",
        dict(do_stable_layer_norm=True, num_buckets=8, max_bucket_distance=16, mask_feature_prob=0.0),
    ),
    "data2vec-audio": ("Data2VecAudioConfig", "Data2VecAudioForCTC", dict(conv_pos_kernel_size=3)),
    "unispeech": ("UniSpeechConfig", "UniSpeechForCTC", dict(feat_extract_norm="layer", do_stable_layer_norm=True)),
    "unispeech-sat": (
        "UniSpeechSatConfig",
        "UniSpeechSatForSequenceClassification",
        dict(classifier_proj_size=8, num_labels=3),
    ),
    "sew": ("SEWConfig", "SEWForCTC", dict(squeeze_factor=2)),
    "wav2vec2-bert": (
        "Wav2Vec2BertConfig",
        "Wav2Vec2BertForCTC",
        dict(
            feature_projection_input_dim=8,
            conv_depthwise_kernel_size=3,
            position_embeddings_type="relative_key",
            left_max_position_embeddings=8,
            right_max_position_embeddings=8,
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_sharing_the_masking_are_exact(float64, family, mode):
    """Every family whose `_mask_hidden_states` is wav2vec2's (SEW-D and Wav2Vec2-Conformer share it too, and are
    refused for other layers: SEW-D's relative position projections, the Conformer's BatchNorm)."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**TINY, **CONV, **NO_DROPOUT, **{**SPEC_AUGMENT, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).train()
    if family == "wav2vec2-bert":
        batch = _features_batch("ctc")
    else:
        batch = audio_batch(head="classification" if "Sequence" in model_name else "ctc")
    loss_type = "sequence_classification" if "Sequence" in model_name else "ctc"
    clipper = check_clipper(model, [batch], speech_loss(loss_type, seed=0), mode=mode)
    assert_embedding_book_kept(clipper, model)


@pytest.mark.parametrize("mode", MODES)
def test_speecht5_speech_prenet(float64, mode):
    """SpeechT5's speech encoder prenet owns the embedding (a module inside an encoder-decoder): same rule."""
    config = transformers.SpeechT5Config(
        vocab_size=12, hidden_size=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, **CONV, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, positional_dropout=0.0,
        speech_decoder_prenet_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, **SPEC_AUGMENT,
        max_speech_positions=64, max_text_positions=16, encoder_max_relative_position=8, pad_token_id=1,
        decoder_start_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.SpeechT5ForSpeechToText(config).train()
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_values": torch.randn(4, SAMPLES, generator=g),
        "attention_mask": torch.ones(4, SAMPLES, dtype=torch.long),
        "labels": torch.randint(3, 12, (4, 5), generator=g),
    }
    clipper = check_clipper(model, [batch], speech_loss("seq2seq_lm", seed=0), mode=mode)
    assert clipper.rules_used[f"speecht5.encoder.prenet.{CHILD}"] == "SpecAugmentRule"
    assert float(model.speecht5.encoder.prenet.masked_spec_embed.grad.norm()) > 0


# ------------------------------------------------------------------------------------------------------- toy owner
class Owner(nn.Module):
    """A wav2vec2-like owner: projected frames, ``masked_spec_embed`` written by ``_mask_hidden_states`` (in the way
    ``variant`` says), then frame 0 zeroed in place by the caller (as wav2vec2's encoder zeroes padded frames)."""

    def __init__(self, variant="rows"):
        super().__init__()
        self.variant = variant
        self.proj = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.masked_spec_embed = nn.Parameter(torch.randn(4))

    def _mask_hidden_states(self, h, mask_time_indices, mask_feature_indices):
        e, variant = self.masked_spec_embed, self.variant
        features = mask_feature_indices[:, None].expand_as(h)
        if variant == "where":
            return torch.where(mask_time_indices[..., None], e.to(h.dtype), h)
        if variant == "another tensor":
            z = torch.zeros_like(h)
            z[mask_time_indices] = e.to(h.dtype)
            return h + z
        if variant == "slice":
            h[:, 1] = e
            return h
        h[mask_time_indices] = e.to(h.dtype)
        if variant == "in place after":
            h.mul_(2)
        elif variant == "tensor after":
            h[features] = h[features] * 2
        else:
            h[features] = 0
        return h

    def forward(self, x, mask_time_indices, mask_feature_indices):
        h = self._mask_hidden_states(self.proj(x), mask_time_indices, mask_feature_indices)
        h[:, 0] = 0
        return self.head(torch.tanh(h))


def owner_batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (5, 3):
        x = torch.randn(n, 6, 3, generator=g)
        out.append({"x": x, "mask_time_indices": torch.rand(n, 6, generator=g) < 0.5,
                    "mask_feature_indices": torch.rand(n, 4, generator=g) < 0.3})  # fmt: skip
    return out


def owner_loss(model, batch):
    return (model(**batch) ** 2).sum((1, 2))


@pytest.mark.parametrize("mode", MODES)
def test_rows_then_zeroed_features_then_a_caller_write(float64, mode):
    torch.manual_seed(0)
    model = Owner()
    clipper = check_clipper(model, owner_batches(), owner_loss, mode=mode)
    assert clipper.rules_used == {"proj": "LinearRule", CHILD: "SpecAugmentRule", "head": "LinearRule"}


@pytest.mark.parametrize(
    "variant,why",
    [
        ("where", "used by `where`"),
        ("another tensor", "written into another tensor"),
        ("slice", "indexed by something else"),
        ("in place after", "changed in place after"),
        ("tensor after", "a tensor is written over"),
    ],
)
def test_other_uses_of_the_embedding_are_refused(float64, variant, why):
    """Exact or refused: anything but whole-row writes into the returned hidden states, and constant writes after."""
    torch.manual_seed(0)
    model = Owner(variant)
    batch = owner_batches()[0]
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=why) as err:
        clipper.backward(owner_loss(model, batch))
    assert "masked_spec_embed" in str(err.value) and "requires_grad_(False)" in str(err.value)
    assert model.masked_spec_embed.grad is None
    clipper.remove()
    frozen = Owner(variant)
    frozen.masked_spec_embed.requires_grad_(False)
    check_clipper(frozen, [batch], owner_loss, mode="bk")  # frozen: nothing to book-keep, as before


# ------------------------------------------------------------------------------------------------------- lifecycle
def test_the_model_is_plain_again_after_remove(float64):
    """While installed the masking runs as a child's call (no parameter of its own: the same names and state dict); a
    deep copy taken then computes the same; after ``remove()`` the owner has no child and its class's method again,
    and plain autograd works."""
    torch.manual_seed(0)
    model = wav2vec2("ctc").eval()
    base = model.wav2vec2
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    batch = audio_batch(mask=True)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    expected = model(**inputs).logits
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    assert isinstance(base._modules[CHILD], SpecAugmentMask)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    clipper.backward(speech_loss("ctc")(model, batch))
    twin = copy.deepcopy(model)  # (wav2vec2's weight-norm convolution cannot be pickled whole: the toy owner is)
    assert twin.wav2vec2._modules[CHILD].owner is twin.wav2vec2
    torch.testing.assert_close(twin(**inputs).logits, expected)
    clipper.remove()
    assert CHILD not in base._modules and "_mask_hidden_states" not in vars(base)
    assert not any(isinstance(m, SpecAugmentMask) for m in model.modules())
    model.zero_grad()
    speech_loss("ctc")(model, batch).sum().backward()
    assert float(base.masked_spec_embed.grad.norm()) > 0
    torch.testing.assert_close(model(**inputs).logits, expected)


def test_a_pickle_taken_while_installed_computes_the_same(float64, tmp_path):
    torch.manual_seed(0)
    model, batch = Owner(), owner_batches()[0]
    expected = model(**batch)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    clipper.backward(owner_loss(model, batch))
    torch.save(model, tmp_path / "owner.pt")
    loaded = torch.load(tmp_path / "owner.pt", weights_only=False)
    assert loaded._modules[CHILD].owner is loaded
    torch.testing.assert_close(loaded(**batch), expected)
    clipper.remove()
    torch.save(model, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert CHILD not in plain._modules and "_mask_hidden_states" not in vars(plain)


def test_an_instance_method_of_the_owner_is_restored(float64):
    """A ``_mask_hidden_states`` set on the instance (patched by the user) is what the call runs, and is put back."""
    torch.manual_seed(0)
    model = Owner()
    calls = []

    def patched(h, *args):
        calls.append(1)
        return Owner._mask_hidden_states(model, h, *args)

    model._mask_hidden_states = patched
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    clipper.backward(owner_loss(model, owner_batches()[0]))
    assert calls and model.masked_spec_embed.grad is not None
    clipper.remove()
    assert model._mask_hidden_states is patched and CHILD not in model._modules


@pytest.mark.parametrize("where", ["gradient", "norm"])
def test_a_nan_from_the_mask_embedding_rule_is_a_mismatch(float64, monkeypatch, where):
    """The check of the mask embedding's rule against autograd (the rule covers a parameter its module does not own):
    a NaN in the rule's gradient or in its ghost norm makes every comparison false, and must count as a mismatch."""
    import hf_dp.engine.foreign_check as foreign_check
    from hf_dp.engine import SelfCheckError
    from hf_dp.layers.grads import InstantiatedGrad

    if where == "gradient":
        real = foreign_check.instantiate
        monkeypatch.setattr(
            foreign_check, "instantiate", lambda g, dtype: InstantiatedGrad(real(g, dtype).value * float("nan"))
        )
    else:
        real = foreign_check.norm_sq
        monkeypatch.setattr(foreign_check, "norm_sq", lambda g, dtype: real(g, dtype) * float("nan"))
    torch.manual_seed(0)
    model = wav2vec2("ctc").eval()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(SelfCheckError, match="disagrees with autograd"):
        speech_loss("ctc")(model, audio_batch(mask=True))
    clipper.remove()
