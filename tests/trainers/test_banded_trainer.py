"""Banded correlated noise in DPTrainer (issue 41): b = 1 is DP-SGD bit for bit; epsilon after T steps is DP-SGD's of
ceil(T / b) steps at (sigma, q_part) under both accountants; calibration, the budget stop, resume, and the refusals."""

import copy
import math
import os

import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args
from transformers import TrainerCallback

from hf_dp import DPTrainer
from hf_dp.accounting import epsilon as accounted_epsilon

BANDED = {"noise_mechanism": "banded-toeplitz"}


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.fixture(scope="module")
def init():
    torch.manual_seed(0)
    return gpt2().state_dict()


class CountedDPTrainer(DPTrainer):
    """DPTrainer whose optimizer records each step before applying it (``applied_steps``): the steps that ran,
    counted apart from hf_dp's own record (the optimizer stays the Trainer's own, so the strategy is unchanged)."""

    applied_steps = 0

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        if not getattr(optimizer, "_counted", False):
            apply = optimizer.step

            def step(*a, **k):
                self.applied_steps += 1
                return apply(*a, **k)

            optimizer.step, optimizer._counted = step, True
        return optimizer


def trained(init, folder, callbacks=(), resume=None, **overrides):
    model = gpt2()
    model.load_state_dict(copy.deepcopy(init))
    trainer = CountedDPTrainer(
        model=model,
        args=dp_args(folder, **overrides),
        train_dataset=ToyDataset(40),
        data_collator=collate,
        callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def assert_same_weights(a, b):
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_one_band_is_dp_sgd_bit_for_bit(tmp_dir, init):
    dpsgd = trained(init, os.path.join(tmp_dir, "a"), max_steps=4)
    banded = trained(init, os.path.join(tmp_dir, "b"), max_steps=4, noise_bands=1, **BANDED)
    assert_same_weights(banded, dpsgd)
    assert banded.applied_steps == dpsgd.applied_steps == 4
    assert banded.dp_callback.history == dpsgd.dp_callback.history
    assert banded.epsilon("rdp") == dpsgd.epsilon("rdp") and banded.epsilon("prv") == dpsgd.epsilon("prv")


def test_banded_noise_differs_from_dp_sgd_and_depends_on_the_bands(tmp_dir, init):
    dpsgd = trained(init, os.path.join(tmp_dir, "a"), max_steps=3)
    banded = trained(init, os.path.join(tmp_dir, "b"), max_steps=3, noise_bands=2, **BANDED)
    three = trained(init, os.path.join(tmp_dir, "c"), max_steps=3, noise_bands=3, **BANDED)
    weight = "transformer.h.0.attn.c_attn.weight"
    assert not torch.equal(banded.model.state_dict()[weight], dpsgd.model.state_dict()[weight])
    assert not torch.equal(three.model.state_dict()[weight], banded.model.state_dict()[weight])


@pytest.mark.parametrize("steps", [4, 5, 6])
def test_epsilon_is_dp_sgd_of_ceil_t_over_b_steps_at_the_part_rate(tmp_dir, init, steps):
    bands = 3
    trainer = trained(init, tmp_dir, max_steps=steps, noise_bands=bands, **BANDED)
    plan = trainer.dp_plan
    assert plan.sample_rate == pytest.approx(bands * 8 / 40)  # q_part = b L / N
    assert trainer.applied_steps == steps
    assert trainer.dp_callback.history == [[1.0, plan.sample_rate, steps]]  # every step that ran is recorded
    participations = math.ceil(steps / bands)
    for name in ("rdp", "prv"):
        expected = accounted_epsilon(
            1.0, sample_rate=plan.sample_rate, steps=participations, delta=plan.delta, accountant=name
        )
        assert trainer.epsilon(name) == pytest.approx(expected, rel=1e-9)
    with open(os.path.join(tmp_dir, "dp_ledger.jsonl")) as f:
        assert '"mechanism": "banded-toeplitz"' in f.read()


def test_calibration_reaches_the_target_at_the_last_step(tmp_dir, init):
    trainer = trained(init, tmp_dir, max_steps=6, noise_bands=2, target_epsilon=4.0, noise_multiplier=None, **BANDED)
    plan = trainer.dp_plan
    assert trainer.applied_steps == trainer.dp_callback.steps == 6
    assert trainer.epsilon() <= 4.0 + 1e-9
    # at the calibrated sigma, DP-SGD's epsilon of ceil(6 / 2) = 3 steps at q_part is the target (the calibration
    # of the accountant, to its tolerance); 6 DP-SGD steps at q_part would exceed it
    three = accounted_epsilon(plan.noise_multiplier, sample_rate=plan.sample_rate, steps=3, delta=plan.delta)
    six = accounted_epsilon(plan.noise_multiplier, sample_rate=plan.sample_rate, steps=6, delta=plan.delta)
    assert three == pytest.approx(4.0, rel=0.02) and six > 4.5


def test_budget_stop_counts_participations(tmp_dir, init):
    trainer = trained(init, tmp_dir, max_steps=4, noise_bands=3, noise_multiplier=1.0, **BANDED)
    callback = trainer.dp_callback
    q, delta = trainer.dp_plan.sample_rate, trainer.dp_plan.delta
    budget = accounted_epsilon(1.0, sample_rate=q, steps=3, delta=delta)  # three participations
    callback.epsilon_budget = budget * (1 + 1e-9)
    # 4 steps taken (2 participations); 3 participations are 7 .. 9 steps of 3 bands: the budget allows 9 in all
    assert callback.steps_within_budget(max_future=100) == 9


def test_resume_with_a_fixed_seed_rebuilds_the_noise_state(tmp_dir, init):
    common = dict(max_steps=6, save_strategy="steps", save_steps=2, noise_bands=3, noise_seed=7, **BANDED)
    full = trained(init, os.path.join(tmp_dir, "a"), **common)
    part = os.path.join(tmp_dir, "b")
    first = trained(init, part, callbacks=[StopAt(4)], **common)  # stops mid-cycle (cycles of 3), checkpoint at 4
    resumed = trained(init, part, resume=True, **common)
    assert (full.applied_steps, first.applied_steps, resumed.applied_steps) == (6, 4, 2)
    assert_same_weights(resumed, full)
    assert resumed.dp_callback.history == full.dp_callback.history
    assert resumed.epsilon() == full.epsilon()


def test_resume_without_the_seed_is_refused_and_says_what_to_do(tmp_dir, init):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, noise_bands=2, noise_seed=None, **BANDED)
    trained(init, tmp_dir, callbacks=[StopAt(2)], **common)
    with pytest.raises(ValueError, match="noise state.*never written.*new run in a new `output_dir`"):
        trained(init, tmp_dir, resume=True, **common)


def test_resume_with_another_band_count_is_refused(tmp_dir, init):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, noise_seed=3, **BANDED)
    trained(init, tmp_dir, callbacks=[StopAt(2)], noise_bands=2, **common)
    with pytest.raises(ValueError, match="another mechanism or band count"):
        trained(init, tmp_dir, resume=True, noise_bands=3, **common)


def test_resume_with_dp_sgd_counts_the_banded_steps_as_dp_sgd_steps(tmp_dir, init):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, noise_seed=None)
    trained(init, tmp_dir, callbacks=[StopAt(2)], noise_bands=2, **common, **BANDED)
    resumed = trained(init, tmp_dir, resume=True, **common)
    q_part, q = 0.4, 0.2
    rdp = resumed.dp_callback.accounted_history()
    assert rdp == [(1.0, q_part, 2), (1.0, q, 2)]  # an over-count of the banded steps (1 participation), never less


def test_more_bands_than_steps_are_refused_before_training(tmp_dir):
    with pytest.raises(ValueError, match="more bands than"):
        DPTrainer(
            model=gpt2(),
            args=dp_args(tmp_dir, max_steps=2, noise_bands=3, **BANDED),
            train_dataset=ToyDataset(40),
            data_collator=collate,
        )


def test_a_part_rate_above_one_is_refused_before_training(tmp_dir):
    with pytest.raises(ValueError, match="fewer bands"):
        DPTrainer(
            model=gpt2(),
            args=dp_args(tmp_dir, max_steps=2, noise_bands=6, **BANDED),  # 6 x 8 > 40
            train_dataset=ToyDataset(40),
            data_collator=collate,
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"adaptive_clipping": True}, "adaptive_clipping"),
        ({"poisson_sampling": False}, "poisson_sampling=True"),
        ({"noise_bands": 0}, "integer >= 1"),
    ],
)
def test_unsupported_settings_are_refused_by_the_arguments(tmp_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        dp_args(tmp_dir, max_steps=2, **{"noise_bands": 2, **BANDED, **overrides})


def test_bands_without_the_mechanism_are_refused(tmp_dir):
    with pytest.raises(ValueError, match="needs `noise_mechanism='banded-toeplitz'`"):
        dp_args(tmp_dir, noise_bands=4)


def test_the_strategy_follows_the_runs_sgd_momentum_and_schedule(tmp_dir, init):
    from hf_dp.step.bandmf import optimize_banded_toeplitz

    steps, lr = 6, 1e-3
    sgd = trained(
        init,
        os.path.join(tmp_dir, "sgd"),
        max_steps=steps,
        noise_bands=2,
        optim="sgd",
        optim_args="momentum=0.9",
        learning_rate=lr,
        lr_scheduler_type="linear",
        **BANDED,
    )
    rates = [lr * (steps - t) / steps for t in range(steps)]  # linear decay to 0, no warm-up
    expected = optimize_banded_toeplitz(steps, 2, momentum=0.9, learning_rates=rates)
    assert sgd._banded_strategy.coefficients == pytest.approx(expected.coefficients, rel=1e-9)
    assert "momentum 0.9" in sgd._banded_strategy.workload
    adam = trained(init, os.path.join(tmp_dir, "adam"), max_steps=steps, noise_bands=2, **BANDED)
    assert adam._banded_strategy is optimize_banded_toeplitz(steps, 2)  # AdamW: the prefix sums
    card = open(os.path.join(tmp_dir, "sgd", "README.md")).read()
    assert sgd._banded_strategy.workload in card


def test_user_level_banded_samples_users_of_one_part_per_step(tmp_dir):
    from helpers.user_level import AuthoredDataset, RecordingCollate, user_args

    from hf_dp.sampling.cyclic import cyclic_parts

    torch.manual_seed(0)
    dataset = AuthoredDataset([1, 2, 5, 3] * 10)  # 40 users, 110 rows
    collate_rows = RecordingCollate()
    args = dp_args(
        tmp_dir,
        max_steps=6,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        noise_bands=3,
        **BANDED,
        **user_args(tmp_dir, max_examples_per_user=3),
    )
    trainer = CountedDPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=collate_rows)
    assert trainer.sample_rate == pytest.approx(3 * 2 / 40)  # q_part = b L / N over users
    trainer.train()
    assert trainer.applied_steps == trainer.dp_callback.steps == 6
    first_seen = list(dict.fromkeys(dataset.authors))
    codes = {author: code for code, author in enumerate(first_seen)}  # the users' codes, in first-seen order
    parts = cyclic_parts(0, 40, 3)  # the sampling seed of a test run is `seed` (0)
    # one micro-batch per step (and the data loader's look-ahead at the next): call t holds draw t's users
    assert len(collate_rows.authors) in (6, 7)
    assert sum(map(bool, collate_rows.authors)) >= 3  # most steps sampled someone
    for draw, authors in enumerate(collate_rows.authors):  # draw t samples users of part t mod 3 only
        assert {int(parts[codes[a]]) for a in authors} <= {draw % 3}, draw
