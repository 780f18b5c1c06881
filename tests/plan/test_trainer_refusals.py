"""Refusals before training, and what reaches the model (issue 26, DESIGN §6 rule 20): optimizers that step inside
the backward, accelerate's dispatcher, Liger kernels, padding-free packing, and one per-example loss per example the
Poisson sampler drew."""

import copy

import numpy as np
import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, check_exact_update, collate, dp_args, one_example_loss, sgd_step_args
from transformers import DataCollatorWithFlattening, Trainer
from transformers.trainer_pt_utils import LayerWiseDummyOptimizer
from transformers.training_args import OptimizerNames

from hf_dp import DPTrainer
from hf_dp.plan.checks import backward_stepping_optims
from hf_dp.sampling.batch_checks import NUM_EXAMPLES_KEY, PACKING_KEYS, position_ids_restart
from hf_dp.sampling.poisson import PoissonBatchSampler


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_untouched(trainer, before):
    """Nothing was spent and nothing was trained."""
    assert trainer.dp_callback.steps == 0
    for b, a in zip(before, trainer.model.parameters(), strict=True):
        assert torch.equal(b, a.detach())


# ---------------------------------------------------------------------------------------------- optimizers
class TestOptimizers:
    def test_refused_list_covers_every_backward_stepping_optim(self):
        refused = backward_stepping_optims()
        for name in ["lomo", "adalomo", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise"]:
            assert name in refused
        assert "galore_adafactor_layerwise" in refused
        assert {o.value for o in OptimizerNames if o.value.endswith("layerwise")} <= set(refused)
        assert not {"adamw_torch", "sgd", "adafactor", "galore_adamw"} & set(refused)

    @pytest.mark.parametrize("optim", backward_stepping_optims())
    def test_backward_stepping_optim_refused_at_init(self, tmp_dir, optim):
        with pytest.raises(ValueError, match=f"`optim='{optim}'`") as raised:
            DPTrainer(model=gpt2(), args=dp_args(tmp_dir, optim=optim), train_dataset=ToyDataset(40))
        message = str(raised.value)
        assert "lomo" in message and "galore_adamw_layerwise" in message and "adamw_torch" in message

    def test_optim_changed_after_init_refused_at_train(self, tmp_dir):
        model = gpt2()
        trainer = DPTrainer(model=model, args=dp_args(tmp_dir, max_steps=1), train_dataset=ToyDataset(40))
        trainer.args.optim = OptimizerNames.LOMO
        before = snapshot(model)
        with pytest.raises(ValueError, match="lomo"):
            trainer.train()
        assert_untouched(trainer, before)

    def test_layerwise_optimizer_objects_refused(self, tmp_dir):
        model = gpt2()
        dummy = LayerWiseDummyOptimizer(optimizer_dict={}, lr=1e-3)
        with pytest.raises(ValueError, match="LayerWiseDummyOptimizer"):
            DPTrainer(model=model, args=dp_args(tmp_dir), train_dataset=ToyDataset(40), optimizers=(dummy, None))
        with pytest.raises(ValueError, match="LayerWiseDummyOptimizer"):
            DPTrainer(
                model=model,
                args=dp_args(tmp_dir),
                train_dataset=ToyDataset(40),
                optimizer_cls_and_kwargs=(LayerWiseDummyOptimizer, {}),
            )

    def test_passed_optimizer_with_post_accumulate_grad_hooks_refused_at_init(self, tmp_dir):
        model = gpt2()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model.transformer.wte.weight.register_post_accumulate_grad_hook(lambda p: None)
        with pytest.raises(ValueError, match="post-accumulate-grad hooks"):
            DPTrainer(model=model, args=dp_args(tmp_dir), train_dataset=ToyDataset(40), optimizers=(optimizer, None))

    def test_model_hooks_registered_after_init_refused_at_train(self, tmp_dir):
        """What layer-wise optimizers do (step in a post-accumulate-grad hook): refused at train() start, before any
        noisy step; the hook never runs."""
        model = gpt2()
        trainer = DPTrainer(
            model=model, args=dp_args(tmp_dir, max_steps=2), train_dataset=ToyDataset(40), data_collator=collate
        )
        calls = []
        model.transformer.h[0].mlp.c_fc.weight.register_post_accumulate_grad_hook(calls.append)
        before = snapshot(model)
        with pytest.raises(ValueError, match=r"post-accumulate-grad hooks registered \(transformer\.h\.0\.mlp\.c_fc"):
            trainer.train()
        assert_untouched(trainer, before)
        assert calls == []

    # Every `optim` value that runs on CPU without extra packages (the others need bitsandbytes, torchao, galore,
    # apollo, schedulefree, ...): not refused, and exact.
    SUPPORTED = ["adamw_torch", "adamw_torch_fused", "adafactor", "adagrad", "rmsprop"]

    @pytest.mark.parametrize("optim", SUPPORTED)
    def test_supported_optim_is_exact(self, float64, tmp_dir, optim):
        """One step with ``optim`` equals that optimizer's step on the clipped mean of the per-example oracle
        gradients (which the SGD run checks against the float64 oracle with ``check_exact_update``)."""
        assert optim not in backward_stepping_optims()
        torch.manual_seed(0)
        dataset = ToyDataset(8)
        init = gpt2()
        sgd_model = copy.deepcopy(init)
        sgd = check_exact_update(sgd_model, dataset, one_example_loss, f"{tmp_dir}/sgd")
        clip = sgd.args.per_sample_max_grad_norm
        clipped_mean = [b.detach() - a.detach() for b, a in zip(init.parameters(), sgd_model.parameters(), strict=True)]

        lr = 1e-2
        args = sgd_step_args(
            f"{tmp_dir}/{optim}",
            optim=optim,
            learning_rate=lr,
            per_sample_max_grad_norm=clip,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
        )
        model = copy.deepcopy(init)
        trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
        trainer.train()
        assert trainer.dp_callback.steps == 1

        reference = copy.deepcopy(init)
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, reference)
        # The Trainer passes weight decay in its parameter groups (here 0 for all), not in the kwargs.
        groups = [{"params": list(reference.parameters()), "weight_decay": args.weight_decay}]
        reference_optimizer = optimizer_cls(groups, **kwargs)
        for p, g in zip(reference.parameters(), clipped_mean, strict=True):
            p.grad = g.clone()
        reference_optimizer.step()
        changed = False
        for name, a, e, b in zip(
            [n for n, _ in model.named_parameters()],
            model.parameters(),
            reference.parameters(),
            init.parameters(),
            strict=True,
        ):
            torch.testing.assert_close(
                a.detach(), e.detach(), rtol=1e-6, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}"
            )
            changed |= not torch.equal(a.detach(), b.detach())
        assert changed

    def test_sgd_is_exact(self, float64, tmp_dir):
        torch.manual_seed(0)
        check_exact_update(gpt2(), ToyDataset(8), one_example_loss, tmp_dir)


# ---------------------------------------------------------------------------------------------- accelerate, Liger
class TestAccelerateAndLiger:
    @pytest.mark.parametrize("name", ["dispatch_batches", "split_batches"])
    def test_batch_dispatching_refused_at_init(self, tmp_dir, name):
        args = dp_args(tmp_dir, accelerator_config={name: True})
        with pytest.raises(ValueError, match=rf"`{name}=True`.*Set `accelerator_config=\{{\"{name}\": False\}}`"):
            DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)

    def test_dispatcher_enabled_on_the_accelerator_refused_at_train(self, tmp_dir):
        model = gpt2()
        trainer = DPTrainer(
            model=model, args=dp_args(tmp_dir, max_steps=1), train_dataset=ToyDataset(40), data_collator=collate
        )
        trainer.accelerator.dataloader_config.dispatch_batches = True
        before = snapshot(model)
        with pytest.raises(ValueError, match="dispatch_batches"):
            trainer.train()
        assert_untouched(trainer, before)

    @pytest.mark.parametrize("even_batches", [True, False])
    def test_even_batches_is_harmless(self, tmp_dir, even_batches):
        """accelerate pads only when it shards batches across processes, which DPTrainer turns off (its sampler is
        rank-aware): with either setting the prepared loader yields the sampler's micro-batches, none padded."""
        args = dp_args(tmp_dir, max_steps=2, accelerator_config={"even_batches": even_batches})
        trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
        loader = trainer.get_train_dataloader()
        sampler = loader.batch_sampler
        while not isinstance(sampler, PoissonBatchSampler):
            sampler = sampler.batch_sampler
        assert [batch[NUM_EXAMPLES_KEY] for batch in loader if NUM_EXAMPLES_KEY in batch] == [
            len(b) for b in sampler if b
        ]
        trainer.train()
        assert trainer.dp_callback.steps == 2

    def test_liger_kernel_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="use_liger_kernel"):
            DPTrainer(model=gpt2(), args=dp_args(tmp_dir, use_liger_kernel=True), train_dataset=ToyDataset(40))


# ---------------------------------------------------------------------------------------------- packing
class PaddingFreeCollator:
    """Stands for TRL's ``DataCollatorForLanguageModeling(padding_free=True)``."""

    padding_free = True

    def __call__(self, features):
        return collate(features)


def keyed_collate(key):
    def collate_with_key(features):
        batch = collate(features)
        batch[key] = torch.zeros(len(features) + 1, dtype=torch.int32)
        return batch

    return collate_with_key


def hf_position_ids(mask):
    """Position ids as HF models build them from the attention mask (left or right padding)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def positions_collate(features):
    batch = collate(features)
    batch["position_ids"] = hf_position_ids(batch["attention_mask"])
    return batch


class PrePacked(ToyDataset):
    """A packed dataset: every row holds two sequences, whose position ids restart in the middle of the row."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        half = item["input_ids"].shape[0] // 2
        item["attention_mask"] = torch.ones_like(item["attention_mask"])
        item["position_ids"] = torch.cat([torch.arange(half), torch.arange(item["input_ids"].shape[0] - half)])
        return item


class TestPacking:
    def test_flattening_collator_refused_at_init(self, tmp_dir):
        with pytest.raises(ValueError, match="padding_free=False.*packing_strategy='wrapped'"):
            DPTrainer(
                model=gpt2(),
                args=dp_args(tmp_dir),
                train_dataset=ToyDataset(40),
                data_collator=DataCollatorWithFlattening(),
            )

    def test_padding_free_collator_refused_at_init(self, tmp_dir):
        with pytest.raises(ValueError, match="`PaddingFreeCollator` has `padding_free=True`"):
            DPTrainer(
                model=gpt2(), args=dp_args(tmp_dir), train_dataset=ToyDataset(40), data_collator=PaddingFreeCollator()
            )

    def test_flattening_collator_set_after_init_refused_at_train(self, tmp_dir):
        model = gpt2()
        trainer = DPTrainer(
            model=model, args=dp_args(tmp_dir, max_steps=1), train_dataset=ToyDataset(40), data_collator=collate
        )
        trainer.data_collator = DataCollatorWithFlattening()
        before = snapshot(model)
        with pytest.raises(ValueError, match="DataCollatorWithFlattening"):
            trainer.train()
        assert_untouched(trainer, before)

    @pytest.mark.parametrize("key", PACKING_KEYS)
    def test_packed_batch_keys_refused_before_the_first_step(self, tmp_dir, key):
        model = gpt2()
        trainer = DPTrainer(
            model=model,
            args=dp_args(tmp_dir, max_steps=2, dp_self_check=True),
            train_dataset=ToyDataset(40),
            data_collator=keyed_collate(key),
        )
        before = snapshot(model)
        with pytest.raises(ValueError, match=f"carries \\['{key}'\\].*padding_free=False"):
            trainer.train()
        assert_untouched(trainer, before)

    def test_position_ids_restarting_within_a_row_refused(self, tmp_dir):
        model = gpt2()
        trainer = DPTrainer(
            model=model, args=dp_args(tmp_dir, max_steps=2), train_dataset=PrePacked(40), data_collator=collate
        )
        before = snapshot(model)
        with pytest.raises(ValueError, match="`position_ids` that restart within a row.*packing_strategy='wrapped'"):
            trainer.train()
        assert_untouched(trainer, before)

    def test_padded_position_ids_are_not_packing_and_stay_exact(self, float64, tmp_dir):
        """Position ids of right-padded rows (HF's cumsum of the mask) pass, and the update is the oracle's."""
        torch.manual_seed(0)
        check_exact_update(gpt2(), ToyDataset(8), one_example_loss, tmp_dir, data_collator=positions_collate)

    def test_position_ids_restart_detection(self):
        left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        assert not position_ids_restart(hf_position_ids(left), left)
        right = torch.tensor([[1, 1, 1, 0, 0]])
        assert not position_ids_restart(hf_position_ids(right), right)
        packed = torch.tensor([[0, 1, 2, 0, 1]])
        assert position_ids_restart(packed)
        assert position_ids_restart(packed, torch.ones_like(packed))
        assert not position_ids_restart(torch.arange(5)[None].expand(3, 5))
        flag = position_ids_restart(packed)
        assert flag.dim() == 0 and flag.dtype == torch.bool  # stays on the device until read


# ---------------------------------------------------------------------------------------------- one loss per example
def merge_pairs(features):
    """Concatenates examples two by two into one row (packing without position ids)."""
    batch = collate(features)
    rows = (len(features) + 1) // 2
    out = {}
    for key, value in batch.items():
        if len(features) % 2:
            value = torch.cat([value, value[-1:]])
        out[key] = value.reshape(rows, -1)
    return out


def duplicate_first(features):
    return collate([features[0], *features])


def drop_last(features):
    return collate(features[:-1] if len(features) > 1 else features)


class TestOneLossPerSampledExample:
    @pytest.mark.parametrize("collator", [merge_pairs, duplicate_first, drop_last])
    def test_row_count_differs_from_the_sampled_examples(self, tmp_dir, collator):
        model = gpt2()
        trainer = DPTrainer(
            model=model,
            args=dp_args(tmp_dir, max_steps=2, per_device_train_batch_size=8, gradient_accumulation_steps=1),
            train_dataset=ToyDataset(40),
            data_collator=collator,
        )
        before = snapshot(model)
        with pytest.raises(ValueError, match=rf"put \d+ examples in this micro-batch.*`{collator.__name__}`"):
            trainer.train()
        assert_untouched(trainer, before)

    def test_the_count_never_reaches_the_model(self, tmp_dir):
        model = gpt2()
        seen = []
        model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
        args = dp_args(tmp_dir, max_steps=3, dp_self_check=True)
        trainer = DPTrainer(model=model, args=args, train_dataset=ToyDataset(40), data_collator=collate)
        trainer.train()
        assert seen and all(NUM_EXAMPLES_KEY not in keys for keys in seen)
        assert trainer.dp_callback.steps == 3

    def test_every_micro_batch_of_the_trainer_holds_what_was_sampled(self, tmp_dir):
        """Through the accelerate-prepared loader: each micro-batch has one row per sampled index, and no index
        repeats within a logical batch."""

        class Indexed(torch.utils.data.Dataset):
            def __len__(self):
                return 40

            def __getitem__(self, i):
                return {"input_ids": torch.full((SEQ_LEN,), i)}

        args = dp_args(tmp_dir, per_device_train_batch_size=6, gradient_accumulation_steps=3)
        trainer = DPTrainer(model=gpt2(), args=args, train_dataset=Indexed(), data_collator=collate)
        micro = [batch for batch in trainer.get_train_dataloader()]
        assert len(micro) % 3 == 0
        sizes = []
        for step in range(len(micro) // 3):
            indices = []
            for batch in micro[3 * step : 3 * step + 3]:
                if NUM_EXAMPLES_KEY in batch:
                    assert batch["input_ids"].shape[0] == batch[NUM_EXAMPLES_KEY]
                    indices += batch["input_ids"][:, 0].tolist()
            assert len(indices) == len(set(indices))
            sizes.append(len(indices))
        assert sum(sizes) > 0 and len(set(sizes)) > 1  # Poisson sizes, not a fixed batch


SEQ_LEN = 4


class TestSamplerNeverRepeats:
    @pytest.mark.parametrize("secure", [False, True])
    @pytest.mark.parametrize("num_replicas", [1, 2, 3])
    @pytest.mark.parametrize("grouped", [False, True])
    def test_no_index_repeats_within_a_logical_batch(self, secure, num_replicas, grouped):
        n, k, steps = 50, 3, 6
        lengths = np.random.default_rng(1).integers(1, 30, n) if grouped else None
        for epoch, offset in [(0, 0), (2, 5)]:
            shares = []
            for rank in range(num_replicas):
                sampler = PoissonBatchSampler(
                    n,
                    0.6,
                    k,
                    steps_per_epoch=steps,
                    seed=11,
                    draw_offset=offset,
                    secure=secure,
                    num_replicas=num_replicas,
                    rank=rank,
                    lengths=lengths,
                )
                sampler.set_epoch(epoch)
                micro = list(sampler)
                assert len(micro) == steps * k
                shares.append([sum(micro[k * t : k * t + k], []) for t in range(steps)])
            for t in range(steps):
                logical = sum((share[t] for share in shares), [])
                assert logical, "q = 0.6 of 50: an empty logical batch here means the sampler is broken"
                assert len(logical) == len(set(logical)), f"an index repeats in logical batch {t}"
                assert all(0 <= i < n for i in logical)
