"""Issue 39, item 6: a TRL trainer hf_dp does not ship, made private by the recipe of docs/trainer_subclasses.md:
TRL's `RewardTrainer` (a preference pair is the example: its loss is -log sigmoid(r_chosen - r_rejected)), exact against
the float64 per-pair oracle with TRL's own dataset preparation and collator."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from test_composition import assert_update, expected_update

from hf_dp import DPArgumentsMixin, DPTrainerMixin
from hf_dp.sampling.collators import is_empty_batch

trl = pytest.importorskip("trl")
from trl import RewardConfig, RewardTrainer  # noqa: E402

WORDS = ["<pad>", "<unk>", "<eos>", *[f"w{i}" for i in range(30)]]


@dataclass
class DPRewardConfig(DPArgumentsMixin, RewardConfig):
    """The recipe's arguments: the DP fields over TRL's `RewardConfig`."""

    dp_loss_type: str = field(default="causal_lm", metadata={"help": "Not used: the loss is the pair's."})


class DPRewardTrainer(DPTrainerMixin, RewardTrainer):
    """The recipe for TRL's reward modelling: the collator puts a micro-batch's B chosen rows, then its B rejected
    rows, into one batch; the DP step pairs them ([B, 2, T]: the pair is the example), runs the model on the chosen and
    on the rejected rows, and the per-example loss is each pair's own."""

    _dp_arguments_class = DPRewardConfig

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._in_train and not is_empty_batch(inputs):
            half = inputs["input_ids"].shape[0] // 2
            inputs = {
                k: torch.stack([v[:half], v[half:]], dim=1) if k in ("input_ids", "attention_mask") else v
                for k, v in inputs.items()
            }
        return super().training_step(model, inputs, num_items_in_batch)

    def dp_forward(self, model, inputs):
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        chosen = model(input_ids=ids[:, 0], attention_mask=mask[:, 0]).logits[:, 0]
        rejected = model(input_ids=ids[:, 1], attention_mask=mask[:, 1]).logits[:, 0]
        return chosen, rejected

    def compute_per_example_loss(self, outputs, inputs):
        chosen, rejected = outputs
        return -F.logsigmoid(chosen - rejected)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def reward_model():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, num_labels=1, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return LlamaForSequenceClassification(config).double()


def preferences(n: int = 8):
    from datasets import Dataset

    g = torch.Generator().manual_seed(2)

    def text():
        length = int(torch.randint(2, 6, (1,), generator=g))
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 30, (length,), generator=g))

    return Dataset.from_dict({"chosen": [text() for _ in range(n)], "rejected": [text() for _ in range(n)]})


def pair_loss(model, row):
    """The oracle: one prepared pair on its own (no padding), by plain autograd."""
    chosen = model(input_ids=torch.tensor([row["chosen_ids"]])).logits[0, 0]
    rejected = model(input_ids=torch.tensor([row["rejected_ids"]])).logits[0, 0]
    return -F.logsigmoid(chosen - rejected)


def test_a_trl_trainer_hf_dp_does_not_ship_is_exact_through_the_recipe(tmp_path):
    model = reward_model()
    config = dict(
        output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=4,
        gradient_accumulation_steps=2, noise_multiplier=0.0, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, max_steps=1, noise_seed=0, seed=0, use_cpu=True,
        dataloader_pin_memory=False, disable_tqdm=True, save_strategy="no", remove_unused_columns=False,
        center_rewards_coefficient=None, per_sample_max_grad_norm=1.0,
    )  # fmt: skip
    # TRL prepares the data (tokenizes chosen and rejected, appends EOS) in its constructor: build once to read the rows
    probe = DPRewardTrainer(
        model=model, args=DPRewardConfig(**config), train_dataset=preferences(), processing_class=tokenizer()
    )
    rows = list(probe.train_dataset)
    expected, clip = expected_update(model, rows, pair_loss)
    trainer = DPRewardTrainer(
        model=model, args=DPRewardConfig(**{**config, "per_sample_max_grad_norm": clip}),
        train_dataset=preferences(), processing_class=tokenizer(),
    )  # fmt: skip
    assert trainer.sample_rate == 1.0 and list(trainer.train_dataset) == rows
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    trainer.train()
    assert_update(model, before, expected)
