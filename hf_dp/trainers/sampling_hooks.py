"""The Trainer hooks of sampling: the training DataLoader draws Poisson logical batches (:mod:`hf_dp.sampling`), and
the schedule counts the privacy plan's steps."""

from __future__ import annotations

import math
import secrets
from functools import partial
from typing import Any

from torch.utils.data import DataLoader
from transformers.trainer_utils import seed_worker
from transformers.utils import is_datasets_available

from ..sampling.data_checks import check_training_rows, row_targets
from ..sampling.dataloader import poisson_dataloader, rank_aware

__all__ = ["SamplingHooks"]


class SamplingHooks:
    """``get_train_dataloader``, ``get_batch_samples`` and ``set_initial_training_values`` of a DP trainer (part of
    :class:`~hf_dp.trainers.mixin.DPTrainerMixin`)."""

    def get_train_dataloader(self) -> DataLoader:
        """Poisson logical batches split into ``gradient_accumulation_steps`` micro-batches (may be empty)."""
        plan, args = self.dp_plan, self.args
        if not plan.poisson_sampling:
            return super().get_train_dataloader()
        seed = self._sampling_seed
        if seed is None:  # outside train(): draws from a throwaway secret seed (never trained on)
            seed = args.seed if args.noise_seed is not None else secrets.randbits(128)
        # the plan's column, read before the user column is removed
        codes = self._user_codes(plan.user_column)[0] if plan.privacy_unit == "user" else None
        lengths = None
        if args.train_sampling_strategy == "group_by_length":
            # Trainer's own LengthGroupedSampler resolves the lengths (length column, or the first model input).
            lengths = super()._get_train_sampler(self.train_dataset).lengths
        dataset, collator = self._training_rows()
        dataloader = poisson_dataloader(
            dataset,
            collator,
            sample_rate=plan.sample_rate,
            num_micro_batches=args.gradient_accumulation_steps,
            seed=seed,
            draw_offset=self.dp_callback.draw_offset,
            secure=plan.secure_mode,
            num_replicas=args.world_size,
            rank=args.process_index,
            user_codes=codes,
            max_examples_per_user=plan.max_examples_per_user,
            lengths=lengths,
            fsdp_placeholder=self.is_fsdp_enabled,
            bands=plan.noise_bands if plan.banded else None,  # cyclic Poisson sampling: part t mod b at step t
            steps_per_epoch=plan.steps_per_epoch if plan.banded else None,
            **self._dataloader_kwargs(),
        )
        return rank_aware(self.accelerator.prepare(dataloader), dataloader.batch_sampler)

    def _training_rows(self) -> tuple[Any, Any]:
        """The training set and collator as the training DataLoader uses them (the columns the model does not take
        removed, as the Trainer does)."""
        dataset, collator = self.train_dataset, self.data_collator
        if is_datasets_available():
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="Training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="Training")
        return dataset, collator

    def _check_training_data(self, max_rows: int = 512) -> None:
        """Refuse training data with nothing to learn (:mod:`hf_dp.sampling.data_checks`): a sample of the training
        set's rows (evenly spaced, all of a small set), read as the Trainer reads them, before collation, until one
        has a token and a target (usually the first)."""
        dataset = self.train_dataset
        total = len(dataset)
        count = min(total, max_rows)
        indices = sorted({round(i * (total - 1) / max(count - 1, 1)) for i in range(count)})
        check_training_rows((dataset[i] for i in indices), self._row_target_count, total=total)

    def _row_target_count(self, row) -> int | None:
        """The tokens a training row (before collation) has to learn from (`None`: not known before collation)."""
        return row_targets(self.loss_type, row)

    def _dataloader_kwargs(self) -> dict[str, Any]:
        args = self.args
        kwargs = {
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "worker_init_fn": partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
        }
        if args.dataloader_num_workers > 0 and args.dataloader_prefetch_factor is not None:
            kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
        return kwargs

    def get_batch_samples(self, epoch_iterator, num_batches: int, device) -> tuple[list, None]:
        """The micro-batches of one logical step. ``num_items_in_batch`` (a token count over the whole logical batch,
        which couples examples) is never computed for training; evaluation keeps the Trainer's own loss."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        return batch_samples, None

    def set_initial_training_values(self, args, dataloader, *rest):
        """The Trainer's schedule, with the step count of the privacy plan when ``max_steps`` is not set (the user's
        arguments are never modified)."""
        values = list(super().set_initial_training_values(args, dataloader, *rest))
        num_train_epochs, steps_per_epoch, *_, max_steps = values
        if not (args.max_steps and args.max_steps > 0):
            max_steps = self.dp_plan.num_steps
            values[0] = math.ceil(max_steps / steps_per_epoch)
            values[3] = max_steps * values[4]  # num_train_samples = steps x total batch
            values[-1] = max_steps
        return tuple(values)
