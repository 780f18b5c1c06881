"""User-level DP and adaptive clipping through DPTrainer, on a synthetic multi-author data set (no download)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dp_accounting import dp_event, rdp
from helpers.models import gpt2
from helpers.trainer import dp_args, sgd_step_args
from helpers.user_level import AuthoredDataset, RecordingCollate, row_grads, user_args
from transformers import TrainerCallback

from hf_dp import DPTrainer
from hf_dp.step.adaptive_clipping import gradient_noise_multiplier


@pytest.mark.parametrize("k", [5, 2])
def test_one_step_is_the_mean_of_clipped_user_sums(float64, tmp_dir, k):
    """sigma = 0, q = 1 over 4 users of 1, 2, 5 and 2 rows, two micro-batches, SGD lr 1: the update is
    -(1/4) sum_u clip(sum_{i in u} g_i) over the rows the sampler chose (all of them with k = 5; at most 2 per user,
    a random subset, with k = 2), in float64 against per-row autograd."""
    torch.manual_seed(0)
    model = gpt2().double()
    dataset = AuthoredDataset([1, 2, 5, 2])
    reference = copy.deepcopy(model)
    grads = row_grads(reference, dataset, range(len(dataset)))
    collate = RecordingCollate()
    # the clipping norm: the median of the users' full-data norms (some users clipped, some not, with k = 5)
    by_user: dict[str, list[int]] = {}
    for i, a in enumerate(dataset.authors):
        by_user.setdefault(a, []).append(i)
    full = {a: [sum(grads[i][j] for i in rows) for j in range(len(grads[0]))] for a, rows in by_user.items()}
    full_norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gs)) for gs in full.values()])
    clip = float(full_norms.median())
    args = sgd_step_args(
        tmp_dir,
        per_sample_max_grad_norm=clip,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        **user_args(tmp_dir, max_examples_per_user=k),
    )
    before = [p.detach().clone() for p in model.parameters()]
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    assert trainer.sample_rate == 1.0 and trainer.num_train_examples == 4
    trainer.train()
    used = collate.batches
    assert len(used) == 2 and all(used)  # two micro-batches (q = 1: every user is drawn)
    # every user in exactly one micro-batch, at most k of its rows
    seen_users = [a for batch in collate.authors[-2:] for a in dict.fromkeys(batch)]
    assert sorted(seen_users) == sorted(by_user)
    for rows in by_user.values():
        taken = [i for batch in used[-2:] for i in batch if i in rows]
        assert len(taken) == min(k, len(rows)) and len(set(taken)) == len(taken)
    expected = None
    for batch in used[-2:]:
        for a in dict.fromkeys(dataset.authors[i] for i in batch):
            rows = [i for i in batch if dataset.authors[i] == a]
            g_u = [sum(grads[i][j] for i in rows) for j in range(len(grads[0]))]
            norm = torch.sqrt(sum((g**2).sum() for g in g_u))
            c = min(1.0, clip / (float(norm) + 1e-6))
            part = [c * g for g in g_u]
            expected = part if expected is None else [x + y for x, y in zip(expected, part, strict=True)]
    after = [p.detach() for p in model.parameters()]
    for b, a, e in zip(before, after, expected, strict=True):
        torch.testing.assert_close(a - b, -e / 4, rtol=1e-6, atol=1e-12)


def test_user_level_accounting_card_and_delta(tmp_dir):
    """q, N and the default delta count users; epsilon matches dp-accounting's RDP at the user level; the card says
    the unit is one user."""
    torch.manual_seed(0)
    sizes = [1, 2, 5, 3] * 10  # 40 users, 110 rows
    dataset = AuthoredDataset(sizes)
    args = dp_args(
        tmp_dir,
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        **user_args(tmp_dir, max_examples_per_user=3),
    )
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=RecordingCollate())
    assert trainer.num_train_examples == 40
    assert trainer.sample_rate == pytest.approx(4 / 40)
    assert trainer.delta == pytest.approx(1 / 80)
    trainer.train()
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.0)), 4)
    expected = accountant.get_epsilon(1 / 80)
    # dp-accounting's default orders are coarser than ours: ours may only be tighter, by a little
    assert expected * 0.97 <= trainer.epsilon("rdp") <= expected * 1.0001
    card = trainer.dp_model_card_section()
    assert "one user (column `author`)" in card and "at most 3 examples per user" in card
    assert "40 users (110 rows)" in card
    assert "differ in all the data of one user" in card


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"privacy_unit": "user"}, "needs `user_column`"),
        ({"privacy_unit": "user", "user_column": "author"}, "needs `max_examples_per_user`"),
        ({"privacy_unit": "user", "user_column": "author", "max_examples_per_user": 0}, "max_examples_per_user"),
        (
            {"privacy_unit": "user", "user_column": "author", "max_examples_per_user": 2, "poisson_sampling": False},
            "poisson_sampling=True",
        ),
        ({"user_column": "author"}, "privacy_unit='user'"),
        ({"privacy_unit": "person"}, "Unknown `privacy_unit`"),
        ({"adaptive_clipping": True, "clipping_style": "layer-wise"}, "all-layer"),
        ({"adaptive_clipping": True, "target_unclipped_quantile": 1.0}, "target_unclipped_quantile"),
        ({"adaptive_clipping": True, "noise_multiplier": 0.0}, "without noise"),
    ],
)
def test_bad_settings_are_refused(tmp_dir, overrides, match):
    with pytest.raises(ValueError, match=match):
        dp_args(tmp_dir, **overrides)


def test_missing_user_column_or_value_is_refused(tmp_dir):
    dataset = AuthoredDataset([2, 2])
    args = dp_args(
        tmp_dir,
        **user_args(tmp_dir, user_column="writer"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_steps=1,
    )
    with pytest.raises(ValueError, match="writer"):
        DPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=RecordingCollate())
    dataset.authors[1] = None
    args = dp_args(
        tmp_dir, **user_args(tmp_dir), per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=1
    )
    with pytest.raises(ValueError):
        DPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=RecordingCollate())


def test_adaptive_clipping_moves_c_and_splits_the_noise(tmp_dir):
    """C follows the noisy unclipped fraction (down when every unit is under C), is logged and on the card; the
    accountant keeps sigma; the gradient's noise is sigma_grad * C per coordinate."""
    torch.manual_seed(0)
    dataset = AuthoredDataset([1, 2, 3, 2] * 10)
    args = dp_args(
        tmp_dir,
        max_steps=6,
        per_device_train_batch_size=5,
        gradient_accumulation_steps=2,
        per_sample_max_grad_norm=100.0,  # far above every norm: b = 1, so C shrinks by exp(-0.2 * 0.5) a step
        adaptive_clipping=True,
        count_noise_multiplier=1.0,
        **user_args(tmp_dir, max_examples_per_user=3),
    )
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=RecordingCollate())
    plan = trainer.dp_plan
    assert plan.gradient_noise_multiplier == pytest.approx(gradient_noise_multiplier(1.0, 1.0))
    assert plan.gradient_noise_multiplier > plan.noise_multiplier
    clipped_at = []  # the C the clipper clips each step at

    class ClipperNorm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clipped_at.append(trainer.clipper.max_grad_norm)

    trainer.add_callback(ClipperNorm())
    trainer.train()
    norms = trainer.dp_callback.clip_norms
    assert clipped_at == norms  # the engine clips at the adaptive C of the step, the one the noise is scaled by
    assert len(norms) == 6 and norms[0] == 100.0
    # the noisy fraction b is 1 + N(0, 1)/L with L = 10: C moves by exp(-0.2 (b - 0.5)), about 0.905 a step
    ratios = [b / a for a, b in zip(norms, norms[1:], strict=False)]
    assert all(0.80 < r < 1.02 for r in ratios) and norms[-1] < 0.8 * norms[0]
    logged = [h["clip_norm"] for h in trainer.state.log_history if "clip_norm" in h]
    assert logged[0] == pytest.approx(norms[1])
    # the accountant spends the privacy of sigma (not sigma_grad): the same epsilon as a fixed-C run
    fixed = DPTrainer(
        model=gpt2(),
        args=dp_args(
            f"{tmp_dir}/fixed",  # its own folder: a run in the same one would count the adaptive run's steps too
            max_steps=6,
            per_device_train_batch_size=5,
            gradient_accumulation_steps=2,
            **user_args(tmp_dir, max_examples_per_user=3),
        ),
        train_dataset=dataset,
        data_collator=RecordingCollate(),
    )
    fixed.train()
    assert trainer.epsilon() == pytest.approx(fixed.epsilon(), rel=1e-12)
    card = trainer.dp_model_card_section()
    assert "Adaptive clipping" in card and "100 at the first step" in card and "(starting value)" in card


def test_adaptive_noise_scale(tmp_dir):
    """The noise of one step with adaptive clipping has norm sigma_grad * C * sqrt(P) / L (within 10%)."""
    torch.manual_seed(0)
    dataset = AuthoredDataset([2] * 8)
    model = gpt2()
    clean = copy.deepcopy(model)
    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, per_sample_max_grad_norm=0.5)
    DPTrainer(
        model=clean,
        args=sgd_step_args(tmp_dir, **common, **user_args(tmp_dir)),
        train_dataset=dataset,
        data_collator=RecordingCollate(),
    ).train()
    before = [p.detach().clone() for p in model.parameters()]
    args = sgd_step_args(
        tmp_dir,
        **common,
        **user_args(tmp_dir),
        noise_multiplier=2.0,
        adaptive_clipping=True,
        count_noise_multiplier=1.5,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=RecordingCollate())
    trainer.train()
    noise = torch.cat(
        [
            ((a.detach() - b) - (c.detach() - b)).flatten()
            for a, b, c in zip(model.parameters(), before, clean.parameters(), strict=True)
        ]
    )
    sigma_grad = gradient_noise_multiplier(2.0, 1.5)
    expected = sigma_grad * 0.5 * math.sqrt(noise.numel()) / 8
    assert float(noise.norm()) == pytest.approx(expected, rel=0.1)


def test_adaptive_clipping_resumes_with_the_same_c(tmp_dir):
    """A run resumed from its checkpoint continues with the C it had reached, step for step the same trajectory as
    the uninterrupted run (fixed test seeds), and the card lists every step's C."""
    dataset = AuthoredDataset([1, 2, 3, 2] * 10)

    def run(out, **extra):
        torch.manual_seed(0)
        args = dp_args(
            out,
            max_steps=4,
            per_device_train_batch_size=5,
            gradient_accumulation_steps=2,
            per_sample_max_grad_norm=1.0,
            adaptive_clipping=True,
            count_noise_multiplier=2.0,
            save_strategy="steps",
            save_steps=2,
            **user_args(out, max_examples_per_user=3),
            **extra,
        )
        return DPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=RecordingCollate())

    whole = run(f"{tmp_dir}/whole")
    whole.train()
    resumed = run(f"{tmp_dir}/resumed")
    resumed.args.max_steps = 2
    resumed.train()
    again = run(f"{tmp_dir}/resumed")
    again.train(resume_from_checkpoint=f"{tmp_dir}/resumed/checkpoint-2")
    assert len(whole.dp_callback.clip_norms) == 4
    assert again.dp_callback.clip_norms == pytest.approx(whole.dp_callback.clip_norms, rel=1e-9)
    assert len(set(whole.dp_callback.clip_norms)) == 4  # C moved at every step


def test_resume_with_another_unit_of_privacy_is_refused(tmp_dir):
    dataset = AuthoredDataset([2, 2, 2, 2])
    common = dict(
        max_steps=2, per_device_train_batch_size=1, gradient_accumulation_steps=2, save_strategy="steps", save_steps=1
    )
    DPTrainer(
        model=gpt2(),
        args=dp_args(tmp_dir, **common, **user_args(tmp_dir, max_examples_per_user=2)),
        train_dataset=dataset,
        data_collator=RecordingCollate(),
    ).train()
    rows = DPTrainer(
        model=gpt2(),
        args=dp_args(tmp_dir, **common, remove_unused_columns=False),
        train_dataset=dataset,
        data_collator=RecordingCollate(),
    )
    with pytest.raises(ValueError, match="units of privacy do not compose"):
        rows.train(resume_from_checkpoint=f"{tmp_dir}/checkpoint-1")
    rows.train()  # the advice: start over in this output_dir; the user-level steps are said not to be covered
    assert rows.dp_callback.carried_steps == 0
    assert any("unit of privacy is 'user', not 'example'" in note for note in rows.dp_callback.not_covered)
    assert "Not covered by the guarantee above" in rows.dp_model_card_section()
