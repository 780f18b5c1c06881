"""User-level DP test helpers: a multi-author causal-LM dataset, its recording collator, the user-level settings."""

import torch

from .models import VOCAB
from .trainer import causal_per_example_loss

SEQ = 8


class AuthoredDataset(torch.utils.data.Dataset):
    """Causal-LM rows, each written by one author (a string column), with a row id for the tests' collator."""

    def __init__(self, sizes, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.authors = [f"author-{u}" for u, n in enumerate(sizes) for _ in range(n)]
        perm = torch.randperm(len(self.authors), generator=g).tolist()  # an author's rows are not contiguous
        self.authors = [self.authors[i] for i in perm]
        n = len(self.authors)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        lengths = torch.randint(3, SEQ + 1, (n,), generator=g)
        self.mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        self.ids = self.ids.masked_fill(self.mask == 0, 0)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {
            "input_ids": self.ids[i],
            "attention_mask": self.mask[i],
            "labels": labels,
            "author": self.authors[i],
            "row": torch.tensor(i),
        }


class RecordingCollate:
    """Stacks the model inputs and records which rows (and authors) each micro-batch held."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.authors: list[list[str]] = []

    def __call__(self, features):
        self.batches.append([int(f["row"]) for f in features])
        self.authors.append([f["author"] for f in features])
        keys = ("input_ids", "attention_mask", "labels")
        return {k: torch.stack([f[k] for f in features]) for k in keys}


def user_args(tmp_dir, **overrides):
    base = {
        "privacy_unit": "user",
        "user_column": "author",
        "max_examples_per_user": 5,
        "remove_unused_columns": False,
    }
    return {**base, **overrides}


def row_grads(model, dataset, rows):
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for i in rows:
        batch = {k: v.unsqueeze(0) for k, v in dataset[i].items() if isinstance(v, torch.Tensor) and v.dim()}
        g = torch.autograd.grad(causal_per_example_loss(model, batch)[0], params, allow_unused=True)
        out[i] = [torch.zeros_like(p) if x is None else x for x, p in zip(g, params, strict=True)]
    return out
