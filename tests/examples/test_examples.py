"""Smoke tests: each example runs a couple of steps on a tiny slice with a tiny model, offline."""

import json
import sys
from pathlib import Path

import pytest
import torch
from test_demo import load

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
needs_shared = pytest.mark.skipif(not (SHARED / "e2e").exists(), reason="../shared/data not present")

TINY = [
    "--max_steps",
    "2",
    "--logging_steps",
    "1",
    "--use_cpu",
    "true",
    "--dataloader_pin_memory",
    "false",
    "--per_device_train_batch_size",
    "8",
    "--gradient_accumulation_steps",
    "2",
]


@needs_shared
@pytest.mark.parametrize(
    "variant", [[], ["--lora_r", "2", "--lora_target_modules", "c_attn"], ["--prefix_tokens", "2"]]
)
def test_table_to_text_e2e(tmp_path, variant):
    example = load("table_to_text")
    out = tmp_path / "e2e"
    report = example.main(
        [
            "--model_name_or_path",
            str(SHARED / "tokenizers" / "gpt2"),
            "--from_scratch",
            "--config_overrides",
            "n_layer=1,n_embd=32,n_head=2",
            "--train_file",
            str(SHARED / "e2e" / "prefix_format" / "train.txt.gz"),
            "--test_references",
            str(SHARED / "e2e" / "grouped_refs" / "test_grouped.jsonl"),
            "--max_train_samples",
            "64",
            "--max_test_samples",
            "3",
            "--num_beams",
            "2",
            "--max_new_tokens",
            "6",
            "--output_dir",
            str(out),
            "--noise_multiplier",
            "1.0",
            *TINY,
            *variant,
        ]
    )
    assert report["privacy"]["private"] and report["privacy"]["steps"] == 2
    assert set(report["metrics"]) == {"bleu", "rougeL", "test_tables"}
    assert len((out / "predictions.txt").read_text().splitlines()) == 3
    assert json.loads((out / "results.json").read_text())["task"] == "table_to_text"
    assert "## Differential privacy" in (out / "README.md").read_text()


@needs_shared
def test_table_to_text_dart_and_non_private_baseline(tmp_path):
    example = load("table_to_text")
    dart = str(SHARED / "dart" / "dart-v1.1.1-full-dev.json.gz")
    report = example.main(
        [
            "--model_name_or_path",
            str(SHARED / "tokenizers" / "gpt2"),
            "--from_scratch",
            "--config_overrides",
            "n_layer=1,n_embd=32,n_head=2",
            "--train_file",
            dart,
            "--test_references",
            dart,
            "--max_train_samples",
            "32",
            "--max_test_samples",
            "2",
            "--num_beams",
            "1",
            "--max_new_tokens",
            "4",
            "--output_dir",
            str(tmp_path / "dart"),
            "--disable_dp",
            "--target_epsilon",
            "3",
            *TINY,
        ]
    )
    assert report["privacy"] == {"private": False}


def _labelled_tsv(path: Path, sentences) -> Path:
    """A GLUE-style TSV (sentence, label) with labels alternating 0, 1."""
    path.write_text("sentence\tlabel\n" + "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(sentences)))
    return path


def _tiny_mlm(path: Path, sentences):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(sentences + ["It was great terrible ."], trainers.WordLevelTrainer(special_tokens=specials))
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    fast.save_pretrained(path)
    cfg = BertConfig(
        vocab_size=len(fast),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    BertForMaskedLM(cfg).save_pretrained(path)


@pytest.mark.parametrize(
    "head, reported",
    [
        (["prompt"], "prompt"),
        (["classification"], "classification (cls pooling)"),
        (["classification", "--pooling", "mean"], "classification (mean pooling)"),
    ],
)
def test_text_classification(tmp_path, head, reported):
    sentences = [f"a {w} movie" for w in ["good", "bad", "fine", "dull", "fun", "long"] * 8]
    data = _labelled_tsv(tmp_path / "train.tsv", sentences)
    model_dir = tmp_path / "mlm"
    _tiny_mlm(model_dir, sentences)
    example = load("text_classification")
    report = example.main(
        [
            "--model_name_or_path",
            str(model_dir),
            "--head",
            *head,
            "--train_file",
            str(data),
            "--validation_file",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
            "--target_epsilon",
            "8",
            "--eval_strategy",
            "no",
            "--max_eval_samples",
            "16",
            *TINY,
        ]
    )
    privacy = report["privacy"]
    assert privacy["private"] and privacy["epsilon"]["rdp"] <= 8.0 and privacy["steps"] == 2
    assert 0.0 <= report["metrics"]["eval_accuracy"] <= 1.0
    assert report["head"] == reported


@pytest.mark.parametrize("head", [["prompt"], ["classification", "--pooling", "mean"]])
def test_frozen_word_embeddings_stay_fixed_and_test_file_is_scored(tmp_path, head):
    from safetensors.torch import load_file

    sentences = [f"a {w} movie" for w in ["good", "bad", "fine", "dull"] * 8]
    data = _labelled_tsv(tmp_path / "train.tsv", sentences)
    test = _labelled_tsv(tmp_path / "test.tsv", sentences[:6])
    model_dir = tmp_path / "mlm"
    _tiny_mlm(model_dir, sentences)
    before = load_file(model_dir / "model.safetensors")
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(model_dir), "--head", *head, "--train_file", str(data)]
    args += ["--validation_file", str(data), "--test_file", str(test), "--output_dir", str(out)]
    args += ["--freeze_word_embeddings", "true", "--target_epsilon", "8", "--eval_strategy", "no", *TINY]
    report = load("text_classification").main(args)

    after = load_file(out / "model.safetensors")

    def saved(key: str) -> torch.Tensor:  # the mean-pooling classifier stores the bare encoder as ``encoder.*``
        return after["encoder." + key.removeprefix("bert.")] if "mean" in head else after[key]

    words, positions = "bert.embeddings.word_embeddings.weight", "bert.embeddings.position_embeddings.weight"
    assert torch.equal(saved(words), before[words])
    assert not torch.equal(saved(positions), before[positions])  # the rest of the model did train
    assert report["frozen_word_embedding_parameters"] == before[words].numel()
    assert report["test_examples"] == 6 and 0.0 <= report["metrics"]["test_accuracy"] <= 1.0


@pytest.mark.parametrize(
    "head, saved_file",
    [
        (["prompt"], "adapter_model.safetensors"),
        (["classification"], "adapter_model.safetensors"),
        (["classification", "--pooling", "mean"], "model.safetensors"),
    ],
)
def test_text_classification_lora_trains_adapters_and_head_only(tmp_path, head, saved_file):
    from safetensors.torch import load_file

    sentences = [f"a {w} movie" for w in ["good", "bad", "fine", "dull"] * 8]
    data = _labelled_tsv(tmp_path / "train.tsv", sentences)
    model_dir = tmp_path / "mlm"
    _tiny_mlm(model_dir, sentences)
    before = load_file(model_dir / "model.safetensors")
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(model_dir), "--head", *head, "--train_file", str(data)]
    args += ["--validation_file", str(data), "--output_dir", str(out), "--lora_r", "2", "--lora_alpha", "4"]
    args += ["--lora_target_modules", "query,value", "--target_epsilon", "8", "--eval_strategy", "no", *TINY]
    report = load("text_classification").main(args)

    # Oracle for the count: one layer, hidden 16, query and value each get A (2 x 16) and B (16 x 2); the
    # classification heads add their 16 -> 2 linear layer.
    adapters = 2 * (2 * 16 + 16 * 2)
    classifier = 0 if head == ["prompt"] else 16 * 2 + 2
    assert report["lora_r"] == 2 and report["trainable_parameters"] == adapters + classifier
    assert report["privacy"]["steps"] == 2

    saved = load_file(out / saved_file)
    lora_b = {k: v for k, v in saved.items() if "lora_B" in k}
    assert len(lora_b) == 2 and all(v.abs().sum() > 0 for v in lora_b.values())  # B starts at zero: it trained
    if "mean" in head:  # the whole model is saved: every base weight is still the pretrained one, bit for bit
        base = {k: v for k, v in saved.items() if ".base_model.model." in k and "lora_" not in k}
        assert base, "no base weight saved"
        for key, value in base.items():
            name = "bert." + key.split(".base_model.model.", 1)[1].replace(".base_layer.", ".")
            assert torch.equal(value, before[name]), key
    if classifier:
        weights = [k for k in saved if "classifier" in k and k.endswith("weight")]
        assert weights, "the classifier was not saved"
    with pytest.raises(ValueError, match="implied by --lora_r"):  # LoRA already freezes every base weight
        load("text_classification").main([*args, "--freeze_word_embeddings", "true"])


def test_label_word_init_puts_each_label_phrase_embedding_in_the_classifier(tmp_path):
    from transformers import AutoTokenizer

    example = load("text_classification")
    sentences = ["a good movie", "a very long and dull movie"]
    _tiny_mlm(tmp_path, sentences)
    args = example.ModelArguments(model_name_or_path=str(tmp_path), head="classification", pooling="mean")
    model = example.build_model(args, num_labels=2).train()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    example.init_classifier_from_label_words(model, tok, "<S> It was [MASK] .", ["terrible", "great"])
    assert model.training  # the mode is restored
    # Oracle: each phrase encoded alone (no padding), dropout off, mean over its tokens, unit norm.
    model.eval()
    with torch.no_grad():
        for row, phrase in enumerate(["It was terrible .", "It was great ."]):
            hidden = model.encoder(**tok(phrase, return_tensors="pt")).last_hidden_state[0].mean(0)
            torch.testing.assert_close(model.classifier.weight[row], hidden / hidden.norm(), rtol=1e-5, atol=1e-6)
    assert torch.equal(model.classifier.bias, torch.zeros(2))

    data = _labelled_tsv(tmp_path / "train.tsv", sentences * 8)
    cli = ["--model_name_or_path", str(tmp_path), "--train_file", str(data), "--validation_file", str(data)]
    cli += ["--output_dir", str(tmp_path / "out"), "--classifier_init", "label_words", "--noise_multiplier", "1"]
    with pytest.raises(ValueError, match="--pooling mean"):  # the prompt head has no classifier to initialize
        example.main([*cli, "--head", "prompt", *TINY])
    report = example.main([*cli, "--head", "classification", "--pooling", "mean", "--eval_strategy", "no", *TINY])
    assert report["classifier_init"] == "label_words" and report["privacy"]["steps"] == 2


def test_mean_pooling_ignores_padding_and_has_no_unused_parameter(tmp_path):
    example = load("text_classification")
    sentences = ["a good movie", "a very long and dull movie"]
    _tiny_mlm(tmp_path, sentences)
    args = example.ModelArguments(model_name_or_path=str(tmp_path), head="classification", pooling="mean")
    model = example.build_model(args, num_labels=2).eval()
    assert not [n for n, _ in model.named_parameters() if "pooler" in n]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    batch = tok(sentences, padding=True, return_tensors="pt")
    alone = tok(sentences[:1], return_tensors="pt")
    assert batch["attention_mask"][0].sum() < batch["attention_mask"].shape[1]  # the first one is padded
    with torch.no_grad():
        padded = model(**batch).logits[0]
        unpadded = model(**alone).logits[0]
        # Oracle: the mean of the encoder's hidden states over the real tokens only, then the linear layer.
        hidden = model.encoder(**alone).last_hidden_state[0]
        expected = model.classifier(hidden.mean(0))
    torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unpadded, expected, rtol=1e-5, atol=1e-6)


def test_examples_parse_help():
    for name in ["table_to_text", "text_classification"]:
        example = load(name)
        with pytest.raises(SystemExit) as exit_info:
            sys.argv = [name, "--help"]
            example.main(["--help"])
        assert exit_info.value.code == 0


#: LoRA on the tiny GPT-2's attention and MLP input projections (TRL's flags).
PEFT = ["--use_peft", "--lora_r", "2", "--lora_target_modules", "c_attn", "c_fc"]
#: TRL's flags of the TRL-script examples, on CPU in float32, saving only at the end.
TRL_RUN = ["--per_sample_max_grad_norm", "1.0", "--bf16", "false", "--report_to", "none", "--save_strategy", "no"]
TRL_RUN += ["--max_length", "16", *TINY]
TRL_TINY = ["--noise_multiplier", "1.0", *TRL_RUN]


def _tiny_chat_lm(model_dir: Path) -> Path:
    """A tiny GPT-2 and a word-level tokenizer (with a chat template) saved to ``model_dir``, for TRL's scripts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<eos>", "user", "assistant", ":", *"abcdefgh"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    GPT2LMHeadModel(GPT2Config(vocab_size=len(words), n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(
        model_dir
    )
    tokenizer.save_pretrained(model_dir)
    return model_dir


def _jsonl(path: Path, rows) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.mark.parametrize("variant", [[], PEFT])
def test_sft_trl_script_offline(tmp_path, variant):
    """examples/sft.py (TRL's sft.py with the three-name change) on a tiny GPT-2 and word-level tokenizer saved to
    disk, a local jsonl of conversations, gradient checkpointing on (TRL's default)."""
    pytest.importorskip("trl")
    model_dir = _tiny_chat_lm(tmp_path / "tiny-gpt2")
    rows = [
        {"messages": [{"role": "user", "content": "a b c"[: 1 + 2 * (i % 3)]}, {"role": "assistant", "content": "d e"}]}
        for i in range(32)
    ]
    train_file = _jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "out"
    cli = ["--model_name_or_path", str(model_dir), "--train_file", str(train_file), "--output_dir", str(out)]
    report = load("sft").main([*cli, *TRL_TINY, *variant])
    assert report["privacy"]["steps_taken"] == 2 and report["privacy"]["noise_multiplier"] == 1.0
    assert "## Differential privacy" in (out / "README.md").read_text()
    saved = {p.name for p in out.iterdir()}
    assert ("adapter_config.json" in saved) == bool(variant)


def _preference_rows(conversational: bool, n: int = 40) -> list[dict]:
    """Synthetic preference pairs over the tiny tokenizer's words: standard strings, or conversational turns."""
    prompts, chosen, rejected = ["a b", "c", "d e f", "g"], ["a", "b c", "d"], ["h g", "f", "e d c"]
    rows = []
    for i in range(n):
        p, c, r = prompts[i % 4], chosen[i % 3], rejected[(i + 1) % 3]
        if conversational:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": p}],
                    "chosen": [{"role": "assistant", "content": c}],
                    "rejected": [{"role": "assistant", "content": r}],
                }
            )
        else:
            rows.append({"prompt": p + " ", "chosen": c + " <eos>", "rejected": r + " <eos>"})
    return rows


@pytest.mark.parametrize("peft", [[], PEFT], ids=["full", "peft"])
@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_dpo_trl_script_offline(tmp_path, conversational, peft):
    """examples/dpo.py (TRL's dpo.py with the three-name change) on the tiny GPT-2 saved to disk and a local jsonl of
    preference pairs (standard or conversational), gradient checkpointing on, with and without LoRA."""
    pytest.importorskip("trl")
    model_dir = _tiny_chat_lm(tmp_path / "tiny-gpt2")
    train_file = _jsonl(tmp_path / "pairs.jsonl", _preference_rows(conversational))
    out = tmp_path / "out"
    cli = ["--model_name_or_path", str(model_dir), "--train_file", str(train_file), "--output_dir", str(out)]
    cli += ["--max_train_samples", "32", "--gradient_checkpointing", "true", "--beta", "0.5"]
    report = load("dpo").main([*cli, *TRL_TINY, *peft])
    privacy = report["privacy"]
    assert report["task"] == "dpo" and privacy["steps_taken"] == 2 and privacy["num_examples"] == 32
    assert privacy["noise_multiplier"] == 1.0 and 0 < privacy["epsilon"] < float("inf")
    assert json.loads((out / "dp_report.json").read_text())["privacy"]["steps_taken"] == 2
    card = (out / "README.md").read_text()
    assert "## Differential privacy" in card and "one preference pair" in card
    saved = {p.name for p in out.iterdir()}
    assert ("adapter_config.json" in saved) == bool(peft)


def test_dpo_trl_script_target_epsilon_and_refusal(tmp_path):
    """--target_epsilon calibrates the noise for the run; a batch-coupled TRL loss is refused with what to set."""
    pytest.importorskip("trl")
    model_dir = _tiny_chat_lm(tmp_path / "tiny-gpt2")
    train_file = _jsonl(tmp_path / "pairs.jsonl", _preference_rows(False, n=32))
    cli = ["--model_name_or_path", str(model_dir), "--train_file", str(train_file), "--output_dir", str(tmp_path)]
    report = load("dpo").main([*cli, *TRL_RUN, "--target_epsilon", "8"])
    assert report["privacy"]["steps_taken"] == 2 and 0 < report["privacy"]["epsilon"] <= 8.0
    with pytest.raises(ValueError, match="loss_type='sigmoid'"):
        load("dpo").main([*cli, *TRL_TINY, "--loss_type", "aot"])


# ---------------------------------------------------------------- user-level DP (--privacy_unit user)

#: Rows per author of the synthetic multi-author sets: authors of 1, 2 and 5 rows, four of each (12 users, 32 rows).
AUTHOR_SIZES = [1, 2, 5] * 4
#: Micro-batches of 2 users, 2 of them a step: L = 4 users expected of 12.
USER_BATCH = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]


def _authored_rows(words=("good", "bad", "fine", "dull", "fun", "long")):
    """Synthetic reviews, each written by one author; the authors' rows are interleaved, not contiguous."""
    authors = [f"author-{u}" for u, n in enumerate(AUTHOR_SIZES) for _ in range(n)]
    order = torch.randperm(len(authors), generator=torch.Generator().manual_seed(0)).tolist()
    return [
        {"sentence": f"a {words[i % len(words)]} movie", "label": i % 2, "author": authors[j]}
        for i, j in enumerate(order)
    ]


def _write_rows(path: Path, rows) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        delimiter = "\t" if path.suffix == ".tsv" else ","
        lines = [delimiter.join(rows[0])] + [delimiter.join(str(v) for v in r.values()) for r in rows]
        path.write_text("\n".join(lines) + "\n")
    return path


def _user_level(column: str, k: int = 2) -> list[str]:
    return ["--privacy_unit", "user", "--user_column", column, "--max_examples_per_user", str(k)]


def _assert_user_report(report, out: Path, column: str, users: int, rows: int) -> None:
    privacy = report["privacy"]
    assert privacy["private"] and privacy["steps"] == 2
    assert privacy["unit"] == f"user ({column})"
    assert (privacy["users"], privacy["rows"], privacy["max_examples_per_user"]) == (users, rows, 2)
    assert privacy["expected_batch_size"] == 4 and privacy["sample_rate"] == pytest.approx(4 / users)
    assert privacy["delta"] == pytest.approx(1 / (2 * users))  # the default delta counts users
    assert json.loads((out / "results.json").read_text())["privacy"]["unit"] == f"user ({column})"
    card = (out / "README.md").read_text()
    assert f"one user (column `{column}`)" in card and f"{users} users ({rows} rows)" in card


@pytest.mark.parametrize(
    "suffix, variant",
    [
        (".csv", ["--head", "prompt"]),
        # adaptive C; a JSON-lines file; the user column kept through a collator that never sees it
        (
            ".jsonl",
            ["--head", "classification", "--adaptive_clipping", "true", "--count_noise_multiplier", "1"]
            + ["--remove_unused_columns", "false"],
        ),
    ],
)
def test_text_classification_user_level(tmp_path, capsys, suffix, variant):
    rows = _authored_rows()
    data = _write_rows(tmp_path / f"train{suffix}", rows)
    model_dir = tmp_path / "mlm"
    _tiny_mlm(model_dir, [r["sentence"] for r in rows])
    out = tmp_path / "out"
    cli = ["--model_name_or_path", str(model_dir), "--train_file", str(data), "--validation_file", str(data)]
    cli += ["--output_dir", str(out), "--noise_multiplier", "1", "--eval_strategy", "no", "--max_eval_samples", "8"]
    report = load("text_classification").main([*cli, *TINY, *USER_BATCH, *_user_level("author"), *variant])
    _assert_user_report(report, out, "author", users=12, rows=32)
    assert report["train_examples"] == 32
    if "--adaptive_clipping" in variant:
        privacy = report["privacy"]
        assert privacy["adaptive_clipping"] and privacy["clip_norms"][0] == 0.1 and len(privacy["clip_norms"]) == 2
        assert privacy["clip_norm"] > 0 and privacy["clip_norm"] != 0.1  # C moved (from noised counts)
        assert " C " in capsys.readouterr().out  # the logged clip_norm, printed at each logging step
        assert "Adaptive clipping" in (out / "README.md").read_text()
    else:
        assert "adaptive_clipping" not in report["privacy"]


def test_text_classification_user_column_must_exist(tmp_path):
    rows = _authored_rows()
    data = _write_rows(tmp_path / "train.tsv", rows)
    model_dir = tmp_path / "mlm"
    _tiny_mlm(model_dir, [r["sentence"] for r in rows])
    cli = ["--model_name_or_path", str(model_dir), "--train_file", str(data), "--validation_file", str(data)]
    cli += ["--output_dir", str(tmp_path / "out"), "--noise_multiplier", "1", *TINY]
    example = load("text_classification")
    with pytest.raises(ValueError, match=r"'writer' is not a column.*\['author', 'label', 'sentence'\]"):
        example.main([*cli, *_user_level("writer")])
    with pytest.raises(ValueError, match="model input or label column"):
        example.main([*cli, *_user_level("label")])


def test_user_level_flags_parse_and_the_baseline_drops_them(tmp_path):
    load("text_classification")  # puts examples/ on sys.path
    import common

    base = ["--output_dir", str(tmp_path), "--noise_multiplier", "1"]
    flags = [*_user_level("author"), "--adaptive_clipping", "true", "--count_noise_multiplier", "2"]
    *_, args, disable_dp = common.parse_args((), common.COMMON_DEFAULTS, [*base, *flags])
    assert not disable_dp and args.privacy_unit == "user" and args.user_column == "author"
    assert args.max_examples_per_user == 2 and args.adaptive_clipping and args.count_noise_multiplier == 2
    # a user's rows share a micro-batch: the examples' group_by_length default gives way
    assert args.train_sampling_strategy == "random" and common.user_column(args) == "author"
    flags[:2] = ["--privacy_unit=user"]
    *_, args, _ = common.parse_args((), common.COMMON_DEFAULTS, [*base, *flags])
    assert args.privacy_unit == "user" and args.train_sampling_strategy == "random"
    *_, args, disable_dp = common.parse_args((), common.COMMON_DEFAULTS, [*base, *flags, "--disable_dp"])
    assert disable_dp and common.user_column(args) is None and not hasattr(args, "privacy_unit")
    *_, args, _ = common.parse_args((), common.COMMON_DEFAULTS, base)
    assert args.train_sampling_strategy == "group_by_length" and common.user_column(args) is None


def _tiny_gpt2(out: Path) -> list[str]:
    return [
        "--model_name_or_path",
        str(SHARED / "tokenizers" / "gpt2"),
        "--from_scratch",
        "--config_overrides",
        "n_layer=1,n_embd=32,n_head=2",
        "--output_dir",
        str(out),
        "--noise_multiplier",
        "1.0",
    ]


@needs_shared
@pytest.mark.parametrize("column", ["name", "table"])
def test_table_to_text_user_level_on_e2e(tmp_path, column):
    """Derived users of the shared E2E file: its restaurants (name : ...) or its meaning representations."""
    example = load("table_to_text")
    train = SHARED / "e2e" / "prefix_format" / "train.txt.gz"
    import gzip

    with gzip.open(train, "rt", encoding="utf-8") as f:
        tables = [next(f).split("||")[0].strip() for _ in range(64)]
    # oracle: the first field of every E2E MR is its name
    names = {t.split(" | ")[0].removeprefix("name : ") for t in tables}
    users = len(names) if column == "name" else len(set(tables))
    out = tmp_path / "e2e"
    cli = [*_tiny_gpt2(out), "--train_file", str(train), "--max_train_samples", "64"]
    report = example.main([*cli, *TINY, *USER_BATCH, *_user_level(column)])
    _assert_user_report(report, out, column, users=users, rows=64)
    assert report["metrics"] == {}


@needs_shared
def test_table_to_text_user_column_of_a_csv_file_with_adaptive_clipping(tmp_path, capsys):
    """An E2E-style CSV (mr, ref) with an author column, synthetic (no download)."""
    authors = [f"writer-{u}" for u, n in enumerate(AUTHOR_SIZES) for _ in range(n)]
    foods = ["Italian", "French", "Chinese", "English"]
    lines = ["mr,ref,author"] + [
        f'"name[Place {i % 5}], eatType[pub], food[{foods[i % 4]}], priceRange[£20-25]",'
        f"Place {i % 5} is a {foods[i % 4]} pub.,{a}"
        for i, a in enumerate(authors)
    ]
    train = tmp_path / "train.csv"
    train.write_text("\n".join(lines) + "\n", encoding="utf-8")
    example = load("table_to_text")
    examples = example.load_examples(example.DataArguments(train_file=str(train)))
    assert examples[0]["table"] == "name : Place 0 | Type : pub | food : Italian | price : £ 20 - 25"
    assert examples[0]["ref"] == "Place 0 is a Italian pub." and examples[0]["fields"]["author"] == "writer-0"
    out = tmp_path / "csv"
    cli = [*_tiny_gpt2(out), "--train_file", str(train), "--adaptive_clipping", "true", "--count_noise_multiplier", "1"]
    report = example.main([*cli, *TINY, *USER_BATCH, *_user_level("author")])
    _assert_user_report(report, out, "author", users=12, rows=32)
    assert len(report["privacy"]["clip_norms"]) == 2 and report["privacy"]["clip_norm"] > 0
    assert " C " in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"'writer' is not a column.*\['author', 'mr', 'ref'\].*'table'.*'name'"):
        example.main([*cli, *TINY, *_user_level("writer")])


def test_table_to_text_derived_users():
    example = load("table_to_text")
    assert example.e2e_name("name : The Vaults | Type : pub | near : Café Adriatic") == "The Vaults"
    assert example.e2e_name("eatType[pub], name[The Eagle], near[Burger King]") == "The Eagle"
    assert example.e2e_name("Type : pub | area : riverside") is None
    assert example.dart_entity([["Mars Hill College", "JOINED", "1973"], ["x", "p", "y"]]) == "Mars Hill College"
    table = [["[TABLECONTEXT]", "METROPOLITAN_AREA", "Berlin"], ["[TABLECONTEXT]", "[TITLE]", "Metropolitan areas"]]
    assert example.dart_entity(table) == "Metropolitan areas"  # a row of a Wikipedia table: the table
    rows = [{"table": "Type : pub", "ref": "A pub.", "entity": None, "fields": {}}]
    with pytest.raises(ValueError, match="names no entity"):
        example.example_users(rows, "name", "rows")
    assert example.example_users(rows, "table", "rows") == ["Type : pub"]


@needs_shared
def test_e2e_csv_tables_match_the_prefix_format():
    """The original MRs of E2E's dev split, in the prefix layout, are prefix_format/valid.txt's, row for row."""
    import csv

    example = load("table_to_text")
    with open(SHARED / "e2e" / "original" / "devset.csv", encoding="utf-8") as f:
        mrs = [r["mr"] for r in csv.DictReader(f)]
    with open(SHARED / "e2e" / "prefix_format" / "valid.txt", encoding="utf-8") as f:
        tables = [line.split("||")[0].strip() for line in f]
    assert len(mrs) == len(tables) and [example.e2e_prefix_table(m) for m in mrs] == tables


@needs_shared
def test_table_to_text_dart_users():
    """DART: a key of the annotations (``source``) is a user column; ``name`` groups the triple sets by entity."""
    example = load("table_to_text")
    data = example.DataArguments(train_file=str(SHARED / "dart" / "dart-v1.1.1-full-dev.json.gz"))
    examples = example.load_examples(data)
    assert len(examples) == 6980  # one row per annotation (SOURCE.md: 2,768 triple sets)
    sources = example.example_users(examples, "source", "dart")
    assert all(s.startswith(("WikiSQL", "WikiTableQuestions", "webnlg", "e2e")) for s in sources)
    names = example.example_users(examples, "name", "dart")
    assert "[TABLECONTEXT]" not in names[:50] and len(set(names)) < len(
        set(example.example_users(examples, "table", ""))
    )


def test_trl_examples_parse_help(capsys):
    pytest.importorskip("trl")
    for name in ["sft", "dpo"]:
        with pytest.raises(SystemExit) as exit_info:
            load(name).main(["--help"])
        assert exit_info.value.code == 0
        printed = capsys.readouterr().out
        assert "--train_file" in printed and "--target_epsilon" in printed and "--use_peft" in printed
