"""DP reward modelling with TRL: TRL's ``trl/scripts/reward.py`` with the three-name change.

Compared with TRL's script, only ``RewardConfig`` -> ``DPRewardConfig``, ``RewardTrainer`` -> ``DPRewardTrainer`` and
the import change (plus ``--train_file`` for a local json/jsonl/csv/parquet file of preference pairs and
``--max_train_samples``). Every TRL flag keeps its meaning (``--center_rewards_coefficient``, ``--use_peft``,
``--lora_r``, ``--max_length``, ...); the DP flags are hf_dp's (``--target_epsilon``, ``--per_sample_max_grad_norm``,
...). The model is loaded as a sequence classifier with one score (``num_labels=1``, a new score head). The unit of
privacy is one preference pair: one row ``chosen``/``rejected`` (with an explicit ``prompt`` or not, standard or
conversational, with an optional ``margin``). Needs ``pip install 'hf_dp[trl]'``.

    python examples/trl_reward.py --model_name_or_path Qwen/Qwen2-0.5B-Instruct \
        --dataset_name trl-lib/ultrafeedback_binarized \
        --use_peft --lora_task_type SEQ_CLS --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear \
        --learning_rate 1e-4 --per_device_train_batch_size 4 --gradient_accumulation_steps 64 --num_train_epochs 1 \
        --target_epsilon 8 --per_sample_max_grad_norm 1.0 --output_dir Qwen2-0.5B-DP-Reward

With ``--use_peft --lora_task_type SEQ_CLS`` PEFT trains the score head with the adapter (``modules_to_save``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from hf_dp import DPRewardConfig, DPRewardTrainer  # was: from trl import RewardConfig, RewardTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_common import DataFileArguments, finish, load_splits, set_model_init_kwargs  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = TrlParser((ScriptArguments, DPRewardConfig, ModelConfig, DataFileArguments))
    script_args, training_args, model_args, files = parser.parse_args_and_config(
        args=sys.argv[1:] if argv is None else argv
    )
    set_model_init_kwargs(model_args, training_args)  # as TRL's reward.py
    train, evaluation = load_splits(script_args, files, training_args.eval_strategy)

    trainer = DPRewardTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    return finish(trainer, training_args, script_args, "reward")


if __name__ == "__main__":
    main()
