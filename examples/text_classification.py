"""DP fine-tuning for sentence classification (SST-2 and any GLUE-style TSV), with a masked LM.

Two heads:
* ``--head prompt`` (default; Li et al. 2022): prompt infilling. Each sentence becomes ``<S> It was [MASK] .`` and the
  loss is the cross-entropy over the label words' logits (``terrible``/``great``) at the mask position; the MLM head
  is kept (aligned with pretraining).
* ``--head classification``: the ordinary ``AutoModelForSequenceClassification`` head (``--pooling cls``), or
  ``--pooling mean``: a linear classifier on the attention-masked mean of the last hidden states, for encoders
  pretrained with mean pooling (sentence-transformers models such as all-MiniLM-L6-v2), whose ``[CLS]`` pooler was
  not trained. Like the prompt head, it starts from the representation the model was pretrained to produce.

    python examples/text_classification.py --model_name_or_path roberta-base \
        --train_file ../shared/data/sst2/train.tsv.gz --validation_file ../shared/data/sst2/dev.tsv \
        --output_dir out/sst2 --target_epsilon 3
    # same script, non-private baseline:
    python examples/text_classification.py ... --disable_dp
    # user-level DP: the guarantee covers all the sentences of one author (a column of the train file), at most 2 of
    # them in a batch, with a quantile-adaptive clipping norm:
    python examples/text_classification.py ... --train_file reviews.csv --privacy_unit user --user_column author \
        --max_examples_per_user 2 --adaptive_clipping true

User-level DP (``--privacy_unit user --user_column COL --max_examples_per_user k``): ``COL`` is a column of the
training file (CSV/TSV/JSON) or Hub dataset naming each row's user (e.g. a review's author). It is kept through the
preprocessing, so that DPTrainer reads it (users are Poisson-sampled, at most k rows each, and the sum of a user's
per-example gradients is clipped as one); N, q and delta = 1/(2N) then count users. SST-2 has no author column.
Grouping by length is off at user level (``--train_sampling_strategy random``: a user's rows share a micro-batch).

The paper's defaults are the defaults: C = 0.1, expected batch 1024 (``--per_device_train_batch_size`` x
``--gradient_accumulation_steps``), learning rate 5e-4 with AdamW, 3 epochs, delta = 1/(2N).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    PreTrainedModel,
    set_seed,
)
from transformers.modeling_outputs import SequenceClassifierOutput

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    COMMON_DEFAULTS,
    PrintEpsilon,
    WithoutColumns,
    add_lora,
    check_user_column,
    end_distributed,
    make_trainer,
    parse_args,
    privacy_report,
    trainable_parameters,
    user_column,
    write_report,
)

REPORTED_METRICS = ("eval_accuracy", "eval_loss", "test_accuracy", "test_loss")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Masked LM (Hub id or local path)."})
    head: str = field(
        default="prompt",
        metadata={"help": "prompt (infilling) or classification.", "choices": ["prompt", "classification"]},
    )
    pooling: str = field(
        default="cls",
        metadata={
            "help": "With --head classification: cls (the model's own head) or mean (masked mean of the last hidden "
            "states, then a linear layer; for sentence-transformers encoders).",
            "choices": ["cls", "mean"],
        },
    )
    classifier_init: str = field(
        default="random",
        metadata={
            "help": "With --pooling mean: random, or label_words (zero-shot start: row k of the classifier is the "
            "unit-norm pooled embedding of the template filled with label word k, e.g. 'It was great .'; bias 0). "
            "Uses only the label words, no training data, so it costs no privacy.",
            "choices": ["random", "label_words"],
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's."})
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "With --from_scratch: config changes, e.g. 'num_hidden_layers=2,hidden_size=64'."},
    )
    from_scratch: bool = field(default=False, metadata={"help": "Random init from the config (tests, baselines)."})
    freeze_word_embeddings: bool = field(
        default=False,
        metadata={
            "help": "Keep the input word embeddings (and an output layer tied to them) fixed: not trained, no noise "
            "on them. Under DP this takes the largest matrix out of the noise (half of a small BERT's parameters)."
        },
    )
    lora_r: int = field(
        default=0,
        metadata={
            "help": "LoRA rank (0: full fine-tuning). Only the adapters and the classifier train (the prompt head: "
            "the adapters only); under DP the noise then covers far fewer coordinates."
        },
    )
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_target_modules: str | None = field(
        default=None, metadata={"help": "Comma list, e.g. 'query,value'; default: peft's per model type."}
    )


@dataclass
class DataArguments:
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "TSV/CSV/JSON(L) (.gz ok) with text and label columns (and, with --privacy_unit user, the "
            "--user_column naming each row's user)."
        },
    )
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation TSV/CSV."})
    test_file: str | None = field(
        default=None, metadata={"help": "Optional held-out TSV/CSV with labels, scored once after training."}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset instead of files, e.g. 'glue'."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "e.g. 'sst2'."})
    text_column: str = field(default="sentence")
    label_column: str = field(default="label")
    template: str = field(default="<S> It was [MASK] .", metadata={"help": "Prompt; <S> = sentence, [MASK] = mask."})
    label_words: str = field(default="terrible,great", metadata={"help": "One word per class, in label order."})
    max_length: int = field(default=128)
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)


class MeanPoolingClassifier(nn.Module):
    """An encoder (``AutoModel``), the attention-masked mean of its last hidden states, dropout, a linear layer.

    Saved by the Trainer as a state dict (``encoder.*``, ``classifier.*``); the encoder alone is
    ``model.encoder.save_pretrained(...)``.
    """

    def __init__(self, encoder: PreTrainedModel, num_labels: int):
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config
        self.dropout = nn.Dropout(getattr(encoder.config, "hidden_dropout_prob", 0.1))
        self.classifier = nn.Linear(encoder.config.hidden_size, num_labels)

    def pool(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        """The attention-masked mean of the encoder's last hidden states, ``[B, hidden]``."""
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None) -> SequenceClassifierOutput:
        logits = self.classifier(self.dropout(self.pool(input_ids, attention_mask, token_type_ids)))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def build_model(model_args: ModelArguments, num_labels: int) -> nn.Module:
    """The masked LM (prompt head), the model's sequence-classification head, or a mean-pooling classifier."""
    if model_args.head == "prompt":
        model_cls, extra = AutoModelForMaskedLM, {}
    elif model_args.pooling == "cls":
        model_cls, extra = AutoModelForSequenceClassification, {"num_labels": num_labels}
    else:
        model_cls, extra = AutoModel, {}
    if model_args.from_scratch:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, **extra)
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        model = model_cls.from_config(config)
    else:
        model = model_cls.from_pretrained(model_args.model_name_or_path, **extra)
    if model_cls is not AutoModel:
        return with_lora(model, model_args, "SEQ_CLS" if model_cls is AutoModelForSequenceClassification else None)
    if getattr(model, "pooler", None) is not None:
        # The [CLS] pooler is not used: remove it, so that no trainable parameter goes without a gradient.
        model.pooler = None
    return MeanPoolingClassifier(with_lora(model, model_args, None), num_labels)


def with_lora(model: PreTrainedModel, model_args: ModelArguments, task_type: str | None) -> nn.Module:
    """LoRA adapters on ``model`` when ``--lora_r`` is set (``SEQ_CLS``: peft keeps the classifier trainable)."""
    if not model_args.lora_r:
        return model
    return add_lora(model, model_args.lora_r, model_args.lora_alpha, model_args.lora_target_modules, task_type)


@torch.no_grad()
def init_classifier_from_label_words(model: MeanPoolingClassifier, tokenizer, template: str, words: list[str]) -> None:
    """Zero-shot start for the mean-pooling head: row k of the classifier is the unit-norm pooled embedding of the
    template with its mask filled by label word k and its sentence slot left out; the bias is 0. The logits then
    start as (pooled norm) x cosine similarity to each label's phrase: the similarity the encoder was trained for."""
    phrases = [template.replace("<S>", "").replace("[MASK]", word).strip() for word in words]
    batch = tokenizer(phrases, padding=True, return_tensors="pt")
    was_training = model.training
    model.eval()
    prototypes = model.pool(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    model.train(was_training)
    model.classifier.weight.copy_(prototypes / prototypes.norm(dim=-1, keepdim=True))
    model.classifier.bias.zero_()


def freeze_word_embeddings(model: nn.Module) -> int:
    """Stop training the input word embeddings (an output layer tied to them shares the tensor); return their size."""
    owner = model.encoder if isinstance(model, MeanPoolingClassifier) else model
    weight = owner.get_input_embeddings().weight
    weight.requires_grad_(False)
    return weight.numel()


def load_splits(data: DataArguments):
    """Train and evaluation splits (Hub dataset or files), and the optional labelled test file (else None)."""
    from datasets import load_dataset

    def read(path: str):
        if ".json" in path:  # .json, .jsonl (.gz ok): one object per row
            return load_dataset("json", data_files=path)["train"]
        delimiter = "\t" if ".tsv" in path else ","
        return load_dataset("csv", data_files=path, delimiter=delimiter, quoting=3)["train"]

    test = read(data.test_file) if data.test_file else None
    if data.dataset_name:
        raw = load_dataset(data.dataset_name, data.dataset_config_name)
        return raw["train"], raw["validation"], test
    return read(data.train_file), read(data.validation_file), test


def label_word_ids(tokenizer, words: list[str]) -> list[int]:
    ids = []
    for word in words:
        candidates = [
            tokenizer(" " + word, add_special_tokens=False)["input_ids"],
            tokenizer(word, add_special_tokens=False)["input_ids"],
        ]
        single = [c for c in candidates if len(c) == 1]
        if not single:
            raise ValueError(f"Label word {word!r} is not one token for this tokenizer; choose other `--label_words`.")
        ids.append(single[0][0])
    return ids


def encode_prompt(batch, tokenizer, data: DataArguments):
    before, after = data.template.split("<S>")
    suffix = after.replace("[MASK]", tokenizer.mask_token).strip()
    texts = [(before + s).strip() for s in batch[data.text_column]]
    enc = tokenizer(texts, [suffix] * len(texts), truncation="only_first", max_length=data.max_length)
    labels = []
    for ids, y in zip(enc["input_ids"], batch[data.label_column], strict=True):
        row = [-100] * len(ids)
        row[ids.index(tokenizer.mask_token_id)] = int(y)
        labels.append(row)
    enc["labels"] = labels
    return enc


def prompt_loss(outputs, labels, num_items_in_batch=None, *, word_ids, per_example=True):
    """Cross-entropy over the label words at the mask position: one loss per example (or their mean)."""
    logits = outputs["logits"]
    at_mask = labels != -100
    word_logits = logits[at_mask][:, word_ids].float()
    loss = torch.nn.functional.cross_entropy(word_logits, labels[at_mask], reduction="none")
    return loss if per_example else loss.mean()


def main(argv=None):
    own = "--per_device_train_batch_size 32 --gradient_accumulation_steps 32 "
    own += "--learning_rate 5e-4 --num_train_epochs 3 --eval_strategy epoch"
    defaults = [*COMMON_DEFAULTS, *own.split()]
    model_args, data_args, args, disable_dp = parse_args((ModelArguments, DataArguments), defaults, argv)
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    train_raw, eval_raw, test_raw = load_splits(data_args)
    user_col = user_column(args)  # privacy_unit="user": the column naming each training row's user
    if user_col is not None:
        check_user_column(user_col, train_raw.column_names, data_args.train_file or data_args.dataset_name)
    if data_args.max_train_samples:
        train_raw = train_raw.select(range(min(data_args.max_train_samples, len(train_raw))))
    if data_args.max_eval_samples:
        eval_raw = eval_raw.select(range(min(data_args.max_eval_samples, len(eval_raw))))
    num_labels = len(data_args.label_words.split(","))

    if model_args.pooling == "mean" and model_args.head != "classification":
        raise ValueError("--pooling mean goes with --head classification.")
    if model_args.classifier_init != "random" and model_args.pooling != "mean":
        raise ValueError("--classifier_init label_words goes with --head classification --pooling mean.")
    if model_args.lora_r and model_args.freeze_word_embeddings:
        raise ValueError("--freeze_word_embeddings is implied by --lora_r (LoRA trains no base weight); drop it.")
    set_seed(args.seed)  # the new head's initialization (or the whole model, --from_scratch) follows --seed
    model = build_model(model_args, num_labels)
    if model_args.classifier_init == "label_words":
        init_classifier_from_label_words(model, tokenizer, data_args.template, data_args.label_words.split(","))
    frozen = freeze_word_embeddings(model) if model_args.freeze_word_embeddings else 0
    if isinstance(model, MeanPoolingClassifier) and not disable_dp and args.dp_loss_type == "auto":
        args.dp_loss_type = "sequence_classification"  # not an HF class, so DPTrainer cannot infer it

    columns = train_raw.column_names
    if model_args.head == "prompt":
        word_ids = label_word_ids(tokenizer, data_args.label_words.split(","))
        encode = partial(encode_prompt, tokenizer=tokenizer, data=data_args)
        collator = DataCollatorForTokenClassification(tokenizer)
        loss_dp = partial(prompt_loss, word_ids=word_ids, per_example=True)
        loss_plain = partial(prompt_loss, word_ids=word_ids, per_example=False)

        def reduce_logits(logits, labels):
            return logits[labels != -100][:, word_ids]

        def accuracy(pred):
            labels = pred.label_ids[pred.label_ids != -100]
            return {"accuracy": float((np.argmax(pred.predictions, -1) == labels).mean())}
    else:

        def encode(batch):
            enc = tokenizer(batch[data_args.text_column], truncation=True, max_length=data_args.max_length)
            enc["labels"] = [int(y) for y in batch[data_args.label_column]]
            return enc

        collator, loss_dp, loss_plain, reduce_logits = DataCollatorWithPadding(tokenizer), None, None, None

        def accuracy(pred):
            return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    # The user column stays in the training set: DPTrainer reads each row's user from it, then (remove_unused_columns,
    # the default) drops it with the other non-model columns; WithoutColumns keeps it from the collator otherwise.
    train_ds = train_raw.map(encode, batched=True, remove_columns=[c for c in columns if c != user_col])
    if user_col is not None:
        collator = WithoutColumns(collator, [user_col])
    eval_ds = eval_raw.map(encode, batched=True, remove_columns=eval_raw.column_names)
    test_ds = None if test_raw is None else test_raw.map(encode, batched=True, remove_columns=test_raw.column_names)
    trainer = make_trainer(
        disable_dp,
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=accuracy,
        preprocess_logits_for_metrics=reduce_logits,
        callbacks=[PrintEpsilon()],
        **({"compute_loss_func": loss_plain} if disable_dp and loss_plain else {}),
        **({"compute_loss_func_dp": loss_dp} if not disable_dp and loss_dp else {}),
    )
    trainer.train()
    metrics = trainer.evaluate()
    if test_ds is not None:
        metrics.update(trainer.predict(test_ds, metric_key_prefix="test").metrics)
    trainer.save_model(args.output_dir)
    report = {
        "task": "text_classification",
        "head": model_args.head if model_args.head == "prompt" else f"classification ({model_args.pooling} pooling)",
        "model": model_args.model_name_or_path,
        "train_examples": len(train_ds),
        "eval_examples": len(eval_ds),
        **({} if test_ds is None else {"test_examples": len(test_ds)}),
        "wall_time_s": round(time.time() - start, 1),
        "learning_rate": args.learning_rate,
        "lr_scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "epochs": args.num_train_epochs,
        "frozen_word_embedding_parameters": frozen,
        "classifier_init": model_args.classifier_init if isinstance(model, MeanPoolingClassifier) else None,
        "lora_r": model_args.lora_r,
        "trainable_parameters": trainable_parameters(model),
        "privacy": privacy_report(trainer),
        "metrics": {k: metrics[k] for k in REPORTED_METRICS if k in metrics},
    }
    if trainer.is_world_process_zero():
        write_report(args.output_dir, report)
    return report


if __name__ == "__main__":
    main()
    end_distributed()
    sys.exit(0)
