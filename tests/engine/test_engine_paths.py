"""A model that takes another path on another batch: layouts proven again on examples that take it (float64 oracle).

T5 builds its encoder attention mask only when some example of the batch is padded. The plan is proven on
sub-batches of one and two examples; when those examples are not padded and others are (or when a later batch is
padded and the first was not), the mask is a tensor in the real forward pass and ``None`` in the probe, and the
fallback covering T5's relative attention bias must not pass it whole to each example's re-run.
"""

import copy

import pytest
import torch
from helpers.models import padded_ids, seq2seq_loss, t5
from helpers.oracle import check_clipper

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]


def _batch(lengths, target_lengths, source_len, target_len, seed):
    ids, mask = padded_ids(lengths, source_len, seed=seed)
    labels, label_mask = padded_ids(target_lengths, target_len, seed=seed + 5)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(label_mask == 0, -100)}


@pytest.fixture(scope="module")
def t5_model():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = t5().double().eval()
    torch.set_default_dtype(previous)
    return model


@pytest.mark.parametrize("mode", MODES)
def test_padding_only_beyond_the_probed_examples(float64, t5_model, mode):
    """The failing shapes of DPSeq2SeqTrainer: 4 examples, source length 6, the first two unpadded."""
    batches = [
        _batch([6, 6, 4, 3], [3, 3, 2, 3], 6, 3, seed=0),
        _batch([6, 6, 6, 6], [3, 2, 3, 3], 6, 3, seed=1),  # no mask at all: the first layouts still hold
        _batch([6, 6, 5, 6], [3, 3, 3, 1], 6, 3, seed=2),
    ]
    check_clipper(copy.deepcopy(t5_model), batches, seq2seq_loss, mode=mode)


@pytest.mark.parametrize("size", range(1, 7))
def test_micro_batch_and_length_sweep(float64, t5_model, size):
    """Micro-batches of 1..6 through one clipper, source/target lengths below, equal to and above the micro-batch,
    unpadded, padded beyond the first two examples, all padded, and only the first padded."""
    batches, seed = [], 0
    for source_len, target_len in [(3, 2), (size, size), (6, 3)]:
        patterns = [
            [source_len] * size,
            [source_len] * min(2, size) + [max(1, source_len - 1 - i % 2) for i in range(size - 2)],
            [max(1, source_len - 2)] + [source_len] * (size - 1),
        ]
        for lengths in patterns:
            targets = [max(1, target_len - i % 2) for i in range(size)]
            batches.append(_batch(lengths, targets, source_len, target_len, seed))
            seed += 1
    check_clipper(copy.deepcopy(t5_model), batches, seq2seq_loss, mode=MODES[size % len(MODES)])
