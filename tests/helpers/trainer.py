"""DPTrainer test helpers: toy datasets and collators, DP arguments, and the exact-update check of one DP step."""

import copy

import torch

from hf_dp import DPTrainer, DPTrainingArguments

from .models import VOCAB

SEQ = 8


class ToyDataset(torch.utils.data.Dataset):
    """Right-padded token sequences with causal-LM labels and a class label."""

    def __init__(self, n, seed=0, classification=False, trim=False):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        lengths = torch.randint(3, SEQ + 1, (n,), generator=g)
        self.mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        self.ids = self.ids.masked_fill(self.mask == 0, 0)
        self.classes = torch.randint(0, 3, (n,), generator=g)
        self.classification = classification
        self.trim = trim  # unpadded examples (pad with `pad_collate`)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        item = {"input_ids": self.ids[i], "attention_mask": self.mask[i]}
        if self.classification:
            item["token_type_ids"] = torch.zeros_like(self.ids[i])
            item["labels"] = self.classes[i]
        else:
            item["labels"] = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        if self.trim:
            length = int(self.mask[i].sum())
            item = {k: v[:length] if v.dim() else v for k, v in item.items()}
        return item


def collate(features):
    return {k: torch.stack([f[k] for f in features]) for k in features[0]}


PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0, "labels": -100}


def pad_collate(features):
    """Right-pads to the longest example of the micro-batch."""
    longest = max(len(f["input_ids"]) for f in features)
    batch = {}
    for key in features[0]:
        values = [f[key] for f in features]
        if values[0].dim():
            values = [torch.nn.functional.pad(v, (0, longest - len(v)), value=PAD_VALUES[key]) for v in values]
        batch[key] = torch.stack(values)
    return batch


def dp_args(tmp_dir, **overrides):
    base = dict(
        output_dir=tmp_dir,
        report_to="none",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        noise_seed=0,
        seed=0,
        noise_multiplier=1.0,
        use_cpu=True,
        dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    base.update(overrides)
    return DPTrainingArguments(**base)


def causal_per_example_loss(model, batch):
    """``[B]`` causal-LM losses (mean over each example's own tokens), in the parameters' dtype, independent of
    hf_dp.losses (HF's own loss casts logits to float32)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return ce.sum(1) / (labels != -100).sum(1)


def one_example_loss(model, example):
    """The loss of one example (a batch of one): classification cross-entropy or the causal-LM loss."""
    batch = {k: v.unsqueeze(0) for k, v in example.items()}
    if batch["labels"].dim() == 1:  # classification
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return torch.nn.functional.cross_entropy(logits, batch["labels"])
    return causal_per_example_loss(model, batch)[0]


def sgd_step_args(tmp_dir, **overrides):
    """One plain SGD step (lr 1, constant, no weight decay, no noise): the update is minus the clipped mean."""
    base = dict(
        noise_multiplier=0.0,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_steps=1,
    )
    return dp_args(tmp_dir, **{**base, **overrides})


def check_exact_update(model, dataset, oracle_loss, tmp_dir, data_collator=None, **overrides):
    """sigma = 0, q = 1, SGD lr = 1, one step: the update is exactly -(1/N) sum_i clip(g_i), with ``g_i`` the
    autograd gradient of ``oracle_loss(model, example_i)`` on an untouched copy (C: the median norm, so that some
    examples are clipped and some not)."""
    n = len(dataset)
    reference = copy.deepcopy(model)
    params = [p for p in reference.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(oracle_loss(reference, dataset[i]), params, allow_unused=True) for i in range(n)]
    grads = [[torch.zeros_like(p) if g is None else g for g, p in zip(gi, params, strict=True)] for gi in grads]
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
    clip = float(norms.median())
    assert (norms > clip).any() and (norms < clip).any()
    coef = (clip / (norms + 1e-6)).clamp(max=1.0)
    expected = [sum(coef[i] * grads[i][k] for i in range(n)) / n for k in range(len(params))]
    args = sgd_step_args(
        tmp_dir,
        per_sample_max_grad_norm=clip,
        per_device_train_batch_size=n // 2,
        gradient_accumulation_steps=2,
        **overrides,
    )
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=data_collator or collate)
    assert trainer.sample_rate == 1.0
    trainer.train()
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    for b, a, e in zip(before, after, expected, strict=True):
        torch.testing.assert_close(a - b, -e, rtol=1e-6, atol=1e-10)
    return trainer


class ListDataset(torch.utils.data.Dataset):
    """A map-style dataset over a list of example dicts."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class IndexedDataset(torch.utils.data.Dataset):
    """ToyDataset items plus their index, so that a collator can record which examples each batch used."""

    def __init__(self, n):
        self.inner = ToyDataset(n)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return {**self.inner[i], "idx": torch.tensor(i)}


class RecordingCollate:
    def __init__(self):
        self.batches = []

    def __call__(self, features):
        self.batches.append(sorted(int(f["idx"]) for f in features))
        return collate([{k: v for k, v in f.items() if k != "idx"} for f in features])
