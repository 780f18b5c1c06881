"""The "Supported architectures" table of docs/supported_architectures.md, and the tests that prove each row.

Every row names the test cases that establish it (exactness against the float64 oracle in every clipping mode, or
a clear refusal); the test below checks that those cases exist, so the table cannot claim what no test covers.

    python tests/engine/test_engine_architectures.py   # print the markdown table (paste it into that page)
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
TESTS = Path(__file__).resolve().parents[1]

ALL = "bk, bk-mixopt, per-sample, ghost"

#: (architecture, status, how, proving tests). A test is ``"module::function"`` or ``"models:<case>"`` (a case of
#: tests/engine/test_models.py, run in every mode, with micro-batch != and == sequence length).
ARCHITECTURES: list[tuple[str, str, str, list[str]]] = [
    # whole models
    ("GPT-2 (tied or untied)", f"exact: {ALL}", "closed forms", ["models:gpt2-tied", "models:gpt2-untied"]),
    (
        "BERT, RoBERTa, ALBERT (shared layers)",
        f"exact: {ALL}",
        "closed forms; repeated uses merged exactly",
        ["models:bert-classifier", "models:roberta-mlm", "models:albert-mlm"],
    ),
    ("Llama family (RMSNorm)", f"exact: {ALL}", "closed forms", ["models:llama"]),
    (
        "PEFT LoRA (linear and embedding adapters), prefix tuning",
        f"exact: {ALL}",
        "closed forms",
        [
            "models:gpt2-lora",
            "models:llama-lora-modules-to-save",
            "models:gpt2-prefix",
            "models:gpt2-prefix-projection",
        ],
    ),
    (
        "PEFT DoRA (`use_dora=True`: magnitude vector, direction normalised by the detached weight norm), on "
        "GPT-2 `Conv1D` (`fan_in_fan_out`) and Llama",
        f"exact: {ALL}",
        "fallback on the adapted layer (peft's own forward re-run per example: its `lora_B(lora_A(eye))` "
        "weight-norm use has no batch dimension and no gradient)",
        ["test_dora::test_dora_is_exact", "test_dora::test_dora_through_the_trainer_is_exact"],
    ),
    (
        "PEFT DoRA with `lora_dropout > 0` (peft's DoRA example, TRL's default 0.05)",
        f"exact: {ALL}",
        "fallback on the adapted layer with the forward's dropout mask replayed",
        [
            "test_dora::test_dora_with_lora_dropout_is_exact",
            "test_dora::test_dora_with_lora_dropout_through_the_trainer_is_exact",
        ],
    ),
    (
        "Every PEFT tuner of peft 0.21 (45 types, LoRA's variants) on GPT-2, Llama, BERT and T5",
        "exact: bk, bk-mixopt, ghost (180 of 186 built runs per mode); Lily and Poly refused naming the module",
        "closed forms or the fallback; per tuner: [peft.md](peft.md)",
        ["peft_sweep.test_peft_sweep::test_peft_sample", "peft_sweep.test_peft_sweep::test_peft_full"],
    ),
    (
        "PEFT prompt tuning, P-tuning, multitask prompt tuning, CPT (a prompt encoder run once, copied along a batch)",
        f"exact: {ALL}",
        "each copy's output gradient is its example's; a shared output that reaches the loss otherwise is refused",
        [
            "test_prompt_tuners::test_prompt_learning_is_exact",
            "test_prompt_tuners::test_any_output_copied_along_the_batch_is_exact",
            "test_prompt_tuners::test_prompt_tuning_through_the_trainer_is_exact",
        ],
    ),
    (
        "PEFT LoHa, LoKr on `nn.Linear` (module and rank dropout included)",
        f"exact: {ALL}",
        "closed forms reading the forward's recorded draws; on convolutions the fallback replays them",
        ["test_lycoris::test_lycoris_is_exact", "test_lycoris::test_module_and_rank_dropout_are_read"],
    ),
    (
        "Gradient hooks on trainable parameters (`p.register_hook`: peft's OSF, CPT)",
        f"exact: {ALL}",
        "the hooks applied to each example's gradient before its norm; post-accumulate-grad and module backward "
        "hooks refused naming the parameter or module",
        [
            "test_param_hooks::test_osf_projections_applied_per_example",
            "test_param_hooks::test_hand_written_hooks_exact",
            "test_param_hooks::test_post_accumulate_grad_hook_refused_at_construction",
            "test_param_hooks::test_module_backward_hooks_refused",
        ],
    ),
    (
        "QLoRA: bitsandbytes 4-bit nf4 base + LoRA `all-linear`, bf16/fp16/fp32 compute, gradient checkpointing (CPU)",
        "exact: bk-mixopt; DPTrainer and DPSFTTrainer",
        "LoRA closed form; bitsandbytes' CPU repacking held off ([qlora.md](qlora.md))",
        [
            "test_qlora::test_qlora_per_example_gradients_are_exact",
            "test_qlora::test_one_dp_trainer_step_is_exact",
            "test_qlora::test_one_dp_sft_trainer_step_is_exact",
        ],
    ),
    (
        "Packed sequences (TRL's padding-free `packing=True`: `position_ids` restarting per sequence)",
        "exact per sequence: bk, bk-mixopt, ghost",
        "token-wise rules on the rows re-laid `[S, L, ...]`; any other trainable module, or sequences that see each "
        "other, refused by name",
        [
            "test_packed_sequences::test_gpt2_tied_per_sequence",
            "test_packed_sequences::test_lora_per_sequence",
            "test_packed_sequences::test_sequences_that_attend_to_each_other_are_refused",
        ],
    ),
    (
        "OPT (125m and 350m style)",
        f"exact: {ALL}",
        "closed forms on the flattened `[B*T, d]` rows (proven contiguous per example)",
        ["models:opt", "models:opt-350m-style"],
    ),
    (
        "BART, mBART (scaled tied embeddings, learned positions)",
        f"exact: {ALL}",
        "embeddings: the embedding rule times the measured scale; position tables: fallback on their module, "
        "the decoder's `[1, T, d]` output expanded to the batch",
        ["models:bart-tied", "models:mbart"],
    ),
    (
        "Mixture of experts (Mixtral, Qwen2-MoE): routers, shared experts, fused (`grouped_mm`) or eager experts",
        f"exact: {ALL} (grouped_mm runs in float32 only: checked there at 2e-4; eager experts in float64)",
        "routers and fused experts: fallback on their modules, each output returned as a copy (a router routes with "
        "the logits it returns: that use is counted once); eager experts' data-dependent per-expert calls are not "
        "matched between sub-batches (only calls of modules with trainable parameters are)",
        [
            "test_engine_uses::test_moe_with_fused_experts_float32",
            "test_engine_uses::test_moe_with_eager_experts_float64",
        ],
    ),
    (
        "PEFT LoRA on the expert modules of module-per-expert MoEs (nllb-moe, Switch Transformers)",
        "exact: bk, bk-mixopt, ghost",
        "the expert calls run on rows the router chose: covered by the fallback on the experts container; the "
        "experts' token dropout in training refused naming the container",
        [
            "test_moe_lora::test_nllb_moe_lora_on_experts_is_exact",
            "test_moe_lora::test_lora_on_experts_a_batch_that_routes_otherwise_than_the_probed_examples",
            "test_moe_lora::test_nllb_moe_token_dropout_on_routed_rows_is_refused",
        ],
    ),
    (
        "PEFT LoRA `all-linear` on MoE routers and 3-D expert tensors (`ParamWrapper`, nested)",
        f"exact: {ALL}",
        "fallback on the outermost wrapper of a chain whose inner re-run alone differs (it reads the outer's patch)",
        ["test_engine_uses::test_lora_on_moe_routers_and_experts"],
    ),
    (
        "Modules that use a tensor they return (routers, eager attention weights), outputs written in place by the "
        "caller (`h /= 2`, `h[:, 0] = 0`)",
        f"exact: {ALL}",
        "fallback outputs returned as copies whose gradient is the caller's alone; closed-form outputs hooked on "
        "their storage root; both hooks survive the caller's in-place writes",
        [
            "test_engine_uses::test_module_that_uses_an_output_it_returns",
            "test_engine_uses::test_caller_writes_a_closed_form_output_in_place",
            "test_engine_uses::test_caller_writes_a_fallback_output_in_place",
            "test_engine_uses::test_t5_attention_weights_returned_and_applied",
        ],
    ),
    (
        "T5 with trainable relative attention bias",
        f"exact: {ALL}, with dropout",
        "bias: fallback on the first attention module of each stack (re-run per example), its `[1, h, q, k]` "
        "output expanded to the batch, its attention dropout masks replayed; the rest closed forms",
        [
            "models:t5",
            "test_engine_layouts::test_table_without_batch_dimension_is_covered_by_its_parent",
            "test_engine_layouts::test_models_with_dropout_in_fallback_modules",
        ],
    ),
    (
        "ViT, DeiT",
        f"exact: {ALL}",
        "[CLS]/distillation tokens and position embeddings: fallback on the embeddings module; the rest closed forms",
        ["models:vit", "models:deit"],
    ),
    (
        "`*ForImageClassification` (ViT, ConvNeXt, DeiT, Swin, ...) with `problem_type` single-label, multi-label, "
        "regression",
        "exact through `DPTrainer` (bk-mixopt), loss inferred",
        "ConvNeXt: depthwise convolutions and layer scales on the fallback, the rest closed forms",
        ["test_vision_speech::TestVision"],
    ),
    (
        "wav2vec2 `*ForCTC` (per-example CTC loss) and `*ForSequenceClassification`; SpecAugment in training "
        "(`mask_time_prob`, `mask_feature_prob`), `masked_spec_embed` frozen or trainable; the same masking in "
        "HuBERT, WavLM, Data2VecAudio, UniSpeech(-SAT), SEW, Wav2Vec2-BERT, SpeechT5's speech prenet",
        f"exact: {ALL} (masks drawn by the model, or passed as `mask_time_indices`); through `DPTrainer` with the "
        "three names",
        "`_mask_hidden_states` runs as the call of a child module while the clipper is installed: the embedding's "
        "per-example gradient is the output gradient summed over the rows the recorded mask wrote it into (0 where a "
        "feature mask overwrote it), no re-run and no redraw of numpy's masks; any other use of the embedding "
        "refused. Frozen, its write into `feature_projection`'s output is seen by the hook on its storage root. "
        "(SEW-D and Wav2Vec2-Conformer share the masking and are refused for other layers)",
        [
            "test_vision_speech::TestSpeech",
            "layers.test_spec_augment::test_wav2vec2_masks_drawn_in_training",
            "layers.test_spec_augment::test_wav2vec2_mask_passed_as_input",
            "layers.test_spec_augment::test_the_engine_uses_the_mask_the_forward_pass_drew",
            "layers.test_spec_augment::test_families_sharing_the_masking_are_exact",
            "layers.test_spec_augment::test_speecht5_speech_prenet",
            "layers.test_spec_augment::test_other_uses_of_the_embedding_are_refused",
        ],
    ),
    (
        "BEiT (relative position bias, layer scale)",
        f"exact: {ALL}, with stochastic depth and attention dropout",
        "bias table: fallback on its module, output expanded; layer scales: fallback on each layer (re-run per "
        "example, dropout masks and stochastic-depth draws replayed)",
        ["models:beit", "test_engine_layouts::test_models_with_dropout_in_fallback_modules"],
    ),
    # layers and patterns
    (
        "`nn.Linear`, HF `Conv1D`, `nn.Embedding` (`padding_idx`), `nn.LayerNorm`, RMSNorm family, `nn.Conv1d/2d`",
        f"exact: {ALL}",
        "closed forms (ghost norm or instantiation per layer in bk-mixopt)",
        [
            "layers.test_linear::test_linear_sequence_shapes",
            "layers.test_conv1d_hf::test_hf_conv1d",
            "layers.test_embedding::test_embedding_repeated_ids_and_padding",
            "layers.test_layernorm::test_layernorm",
            "layers.test_rmsnorm::test_rms_norms",
            "layers.test_conv::test_conv2d",
        ],
    ),
    (
        "`nn.EmbeddingBag` (2-D input, or `offsets` with `per_sample_weights`; sum, mean, max), the flat ids and "
        "offsets reaching the model as keywords (`offsets=`), or as its inputs in order (`model(ids, offsets)`, "
        "`model((ids, offsets))`)",
        f"exact: {ALL}",
        "closed form over the bags; the examples of a flat input read from its offsets (one bag an example), not "
        "from its length",
        [
            "test_engine_layouts::test_embedding_bag_with_offsets",
            "layers.test_embedding_bag::test_root_embedding_bag_with_offsets",
            "layers.test_embedding_bag::test_inner_embedding_bag_fed_by_the_root_inputs",
            "layers.test_embedding_bag::test_two_features_of_a_recommendation_model",
        ],
    ),
    (
        "`nn.MultiheadAttention`, `nn.RNN/GRU/LSTM`, grouped or padded convolutions, `nn.Conv3d`, `nn.GroupNorm`, "
        "affine `nn.InstanceNorm*`, any module with its own parameters (also as the root model, returning tuples)",
        f"exact: {ALL}",
        "torch.func fallback: the module re-run per example (vmap, or a loop)",
        [
            "test_engine_layouts::test_fallback_takes_any_module",
            "layers.test_fallback::test_fallback_matches_oracle",
            "layers.test_conv::test_grouped_conv_uses_fallback",
        ],
    ),
    (
        "Subclasses of a supported layer (e.g. `BartScaledWordEmbedding`), rules matched by class name",
        f"exact: {ALL}",
        "checked against autograd on the first batch: the base rule, the base rule times a constant, or the fallback",
        [
            "test_engine_layouts::test_scaled_embedding_tied_to_a_linear_head",
            "test_engine_layouts::test_guessed_rule_that_does_not_hold_goes_to_the_fallback",
        ],
    ),
    (
        "A parameter used outside its module's forward (`F.linear(x, emb.weight)` in a parent)",
        f"exact: {ALL}",
        "fallback on the smallest enclosing module whose inputs and outputs carry the examples",
        [
            "test_engine_layouts::test_functional_use_of_a_hooked_weight",
            "test_self_check::test_an_unhooked_use_is_refused_without_the_fallback",
        ],
    ),
    (
        "Layouts inside the model: `[B*T, d]`, `[T, B, d]`, shared `[1, ...]` activations; micro-batch == length",
        f"exact: {ALL}",
        "proven on sub-batches of 1 and 2 examples, never guessed from a size",
        [
            "test_engine_layouts::test_flattened_rows_per_example",
            "test_engine_layouts::test_batch_second_inside_the_model",
            "layers.test_embedding::test_shared_activation_is_expanded_exactly",
        ],
    ),
    (
        "Multiple choice (`[B, choices, T]` flattened to `[B * choices, T]`, `[1, T]` position ids)",
        f"exact: {ALL} (the number of choices fixed by the first batch)",
        "the shared `[1, T, d]` position embeddings expanded to the rows of each example",
        ["test_engine_layouts::test_broadcast_over_several_rows_per_example"],
    ),
    (
        "Two forward passes of the model before one loss (pairs of inputs)",
        f"exact: {ALL}",
        "both passes book-kept, cross terms exact",
        ["test_engine_layouts::test_two_forward_passes_before_one_loss"],
    ),
    (
        "A path some batches take and others do not (T5's encoder mask, built only when some example is padded)",
        f"exact: {ALL}",
        "layouts proven again in the forward pass on sub-batches of that batch which take the path; kept per "
        "structure of the call",
        [
            "test_engine_paths::test_padding_only_beyond_the_probed_examples",
            "test_engine_paths::test_micro_batch_and_length_sweep",
        ],
    ),
    (
        "Group-wise clipping (`clipping_style`: layer-wise, param-wise, groups of name patterns; tied parameters in "
        "one group) and automatic clipping (`clipping_fn`)",
        "exact: bk, bk-mixopt, per-sample (ghost: all-layer only)",
        "per-group norms from the same book-kept factors; with several groups each group is clipped in the hook of "
        "its last use and its factors freed there",
        [
            "test_engine_policies::test_policy_matches_group_oracle",
            "test_engine_policies::test_modules_sharing_a_parameter_are_one_group",
            "test_engine_policies::test_ghost_mode_takes_automatic_clipping",
        ],
    ),
    (
        "Activation checkpointing, reentrant or not (transformers' `gradient_checkpointing_enable` / "
        "`activation_checkpointing_enable`, `torch.utils.checkpoint(..., use_reentrant=False or True)`)",
        "exact: bk, bk-mixopt, per-sample, every clipping style",
        "no input kept in the forward pass: each checkpointed call's inputs are book-kept from the recomputation in "
        "the backward pass (parameters out of autograd there too); reentrant: the recomputed outputs carry the output "
        "hooks, fed by the region's nested backward",
        [
            "test_engine_checkpointing::test_hf_checkpointing_matches_oracle",
            "test_engine_checkpointing::test_checkpointed_layouts_and_fallbacks",
            "test_engine_checkpointing::test_plain_torch_checkpoint_per_block",
            "test_engine_checkpointing::test_whole_model_checkpointed",
            "test_engine_checkpointing::test_dropout_inside_checkpointed_fallback_is_replayed",
            "test_engine_checkpointing::test_inputs_come_from_the_recomputation",
            "test_engine_reentrant::test_plain_torch_reentrant_checkpoint_per_block",
            "test_engine_reentrant::test_inputs_and_output_hooks_come_from_the_recomputation",
            "test_engine_reentrant::test_trainer_with_reentrant_checkpointing_is_exact",
        ],
    ),
    (
        'FSDP2 (`fsdp=True`, `fsdp_config={"version": 2}`: torch\'s `fully_shard` through accelerate)',
        "exact: bk, bk-mixopt, per-sample, every clipping style (2 gloo processes against 1)",
        "the clipper runs on the unsharded parameters FSDP2 swaps in; each process's clipped sums are "
        "reduce-scattered into the shards group by group; noise per shard, once per coordinate",
        [
            "test_fsdp::test_engine_sharded_clipped_sums_match_one_process",
            "test_fsdp::TestFSDP2",
        ],
    ),
    # refused
    (
        "BatchNorm; InstanceNorm with running statistics",
        "refused at construction",
        "one example's output depends on the others (or buffers change in the forward); the message says what to "
        "use (`GroupNorm`, e.g. Opacus `ModuleValidator.fix`, or a model without BatchNorm such as ViT, ConvNeXt)",
        [
            "test_clipper::test_batchnorm_is_rejected_with_its_name",
            "test_vision_speech::TestVision",
        ],
    ),
    (
        "`nn.Embedding` with `max_norm`, `scale_grad_by_freq` or `sparse`",
        "refused at construction",
        "in-place renormalisation / batch-dependent scale / sparse gradients",
        ["layers.test_embedding::test_unsupported_embedding_options_raise"],
    ),
    (
        "Reentrant checkpointing of a region with no input that requires grad, with a tensor that requires grad "
        "passed by keyword or held in a closure, nested, or around the whole model; checkpointing in ghost mode; "
        "random draws in a checkpointed region inside a fallback module hooked outside it (BEiT with stochastic "
        "depth)",
        "refused at the first forward (or in the backward pass, before anything is added)",
        "reentrant: torch gives such a region's parameters no gradient, or its nested backward would run part of the "
        "rest of the graph (call `model.enable_input_require_grads()`, pass tensors positionally); ghost: a second "
        "backward without book-keeping; BEiT: the recomputation would draw differently from the replay",
        [
            "test_engine_checkpointing::test_reentrant_checkpointing_is_refused",
            "test_engine_reentrant::test_keyword_tensor_that_requires_grad_is_refused",
            "test_engine_reentrant::test_hidden_captured_tensor_is_refused_in_the_backward_pass",
            "test_engine_reentrant::test_nested_reentrant_regions_are_refused",
            "test_engine_reentrant::test_whole_model_inside_reentrant_checkpointing_is_refused",
            "test_engine_checkpointing::test_ghost_mode_refuses_checkpointing",
            "test_engine_checkpointing::test_random_draws_under_an_enclosing_fallback_are_refused",
        ],
    ),
    (
        "Root inputs that are not batch-first (`[T, B, ...]`, also when T == B); `PackedSequence` inputs",
        "refused at the first batch",
        "loss `j` must depend on example `j`'s rows only (checked on the first batch)",
        ["test_engine_lifecycle::test_batch_second_root_inputs_are_refused_even_when_t_equals_b"],
    ),
    (
        "Losses that couple examples; parameters used after the forward (in the loss)",
        "refused at the first batch",
        "unclipped or mixed gradients",
        [
            "test_engine_lifecycle::test_loss_coupling_examples_is_refused",
            "test_engine_lifecycle::test_parameter_used_in_the_loss_is_refused",
        ],
    ),
    (
        "Dropout, stochastic depth, any `torch.rand*`/`bernoulli` draw inside a module covered by the fallback",
        f"exact: {ALL}",
        "recorded in the forward pass, replayed per example in the re-run (`hf_dp/layers/replay.py`)",
        ["test_engine_layouts::test_dropout_inside_a_fallback_is_replayed"],
    ),
    (
        "Alpha dropout inside a module covered by the fallback, in training",
        "refused at the first forward",
        "its draws cannot be replayed per example",
        ["test_engine_layouts::test_random_draws_that_cannot_be_replayed_are_refused"],
    ),
]


def markdown() -> str:
    lines = ["| architecture / layer | status | how |", "|---|---|---|"]
    lines += [f"| {name} | {status} | {how} |" for name, status, how, _ in ARCHITECTURES]
    return "\n".join(lines)


def _test_module(name: str):
    """A test module by its file name, wherever it lives under tests/ (pytest imports test files by that name), or by
    its dotted path from tests/ (``layers.test_linear``)."""
    if "." not in name and name not in sys.modules:
        (path,) = TESTS.rglob(f"{name}.py")
        sys.path.insert(0, str(path.parent))
    return importlib.import_module(name)


def test_every_row_is_proven_by_existing_tests():
    from test_models import CASES

    for name, _, _, refs in ARCHITECTURES:
        assert refs, f"{name}: no test"
        for ref in refs:
            if ref.startswith("models:"):
                case = ref.removeprefix("models:")
                assert case in CASES, f"{name}: no model case {case!r}"
                continue
            module_name, function = ref.split("::")
            module = _test_module(module_name)
            assert callable(getattr(module, function, None)), f"{name}: no test {ref}"


def test_markdown_has_one_line_per_row():
    assert len(markdown().splitlines()) == len(ARCHITECTURES) + 2


def test_docs_page_shows_this_table():
    page = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "docs", "supported_architectures.md"
    )
    with open(page, encoding="utf-8") as f:
        assert markdown() in f.read(), (
            "docs/supported_architectures.md's table is stale: paste `python tests/engine/test_engine_architectures.py`"
        )


if __name__ == "__main__":
    print(markdown())
