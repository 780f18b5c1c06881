"""Issue 39, item 6: sentence-transformers through the recipe of docs/trainer_subclasses.md: a per-pair loss exact
against the float64 per-pair oracle, an in-batch-negatives loss refused before any update."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from test_composition import assert_update, expected_update
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

from hf_dp import DPArgumentsMixin, DPTrainerMixin

st = pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses  # noqa: E402
from sentence_transformers import models as st_models  # noqa: E402
from sentence_transformers.training_args import SentenceTransformerTrainingArguments  # noqa: E402

WORDS = ["<pad>", "<unk>", "[CLS]", "[SEP]", *[f"w{i}" for i in range(30)]]


@dataclass
class DPSentenceTransformerTrainingArguments(DPArgumentsMixin, SentenceTransformerTrainingArguments):
    """The recipe's arguments: the DP fields over sentence-transformers' own."""


class DPCosineTrainer(DPTrainerMixin, SentenceTransformerTrainer):
    """The recipe, per pair: CosineSimilarityLoss is the mean over the batch of (cos(u_i, v_i) - score_i)^2; its
    per-example loss is the pair's own term."""

    _dp_arguments_class = DPSentenceTransformerTrainingArguments

    def dp_forward(self, model, inputs):
        features, _ = self.collect_features(inputs)
        return [model(f)["sentence_embedding"] for f in features]

    def compute_per_example_loss(self, outputs, inputs):
        u, v = outputs
        return (F.cosine_similarity(u, v) - inputs["label"].to(u.dtype)) ** 2


class DPInBatchNegativesTrainer(DPCosineTrainer):
    """MultipleNegativesRankingLoss, per row: each pair's loss reads every other pair's embedding (in-batch
    negatives), so it cannot be clipped per example."""

    def compute_per_example_loss(self, outputs, inputs):
        u, v = outputs
        scores = F.normalize(u, dim=-1) @ F.normalize(v, dim=-1).T * 20.0
        return F.cross_entropy(scores, torch.arange(len(u), device=u.device), reduction="none")


@pytest.fixture
def sentence_model(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    BertModel(config).save_pretrained(tmp_path / "bert")
    fast.save_pretrained(tmp_path / "bert")
    transformer = st_models.Transformer(str(tmp_path / "bert"))
    pooling = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu").double()


def pairs(n: int = 8):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)

    def sentence():
        length = int(torch.randint(2, 6, (1,), generator=g))
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 30, (length,), generator=g))

    return Dataset.from_dict(
        {
            "sentence1": [sentence() for _ in range(n)],
            "sentence2": [sentence() for _ in range(n)],
            "score": torch.rand(n, generator=g).tolist(),
        }
    )


def st_args(tmp_path, clip, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=4,
        gradient_accumulation_steps=2, noise_multiplier=0.0, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, max_steps=1, per_sample_max_grad_norm=clip, noise_seed=0,
        seed=0, use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True, save_strategy="no",
        remove_unused_columns=False,  # sentence-transformers' collator reads the text columns
    )  # fmt: skip
    return DPSentenceTransformerTrainingArguments(**{**values, **overrides})


def cosine_pair_loss(model, row):
    """The oracle: one pair on its own (a batch of one, no padding), by plain autograd."""
    features = [model.preprocess([row["sentence1"]]), model.preprocess([row["sentence2"]])]
    a, b = (model(f)["sentence_embedding"] for f in features)
    return ((F.cosine_similarity(a, b) - torch.tensor([row["score"]], dtype=a.dtype)) ** 2)[0]


def test_sentence_transformers_per_pair_loss_is_exact_through_the_recipe(sentence_model, tmp_path):
    data = pairs()
    expected, clip = expected_update(sentence_model, list(data), cosine_pair_loss)
    trainer = DPCosineTrainer(
        model=sentence_model, args=st_args(tmp_path, clip), train_dataset=data,
        loss=losses.CosineSimilarityLoss(sentence_model),  # sentence-transformers' own argument, passed through
    )  # fmt: skip
    assert trainer.sample_rate == 1.0
    before = [p.detach().clone() for p in sentence_model.parameters() if p.requires_grad]
    trainer.train()
    assert_update(sentence_model, before, expected)
    assert "Differential privacy" in trainer.dp_model_card_section()


def test_an_in_batch_negatives_loss_is_refused_before_any_update(sentence_model, tmp_path):
    trainer = DPInBatchNegativesTrainer(
        model=sentence_model, args=st_args(tmp_path, 1.0), train_dataset=pairs(),
        loss=losses.MultipleNegativesRankingLoss(sentence_model),
    )  # fmt: skip
    before = [p.detach().clone() for p in sentence_model.parameters()]
    with pytest.raises(ValueError, match="depends on the rows of other examples"):
        trainer.train()
    assert trainer.dp_callback.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, sentence_model.parameters(), strict=True))
