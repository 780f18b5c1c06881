"""The DP section of the model card: content, refusals, the card file, the epsilon plot and the packaged template."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from hf_dp.release.model_card import (
    DPModelCardData,
    card_tags,
    format_bound,
    plot_epsilon_curve,
    render_dp_section,
    template_path,
    template_text,
    write_dp_model_card,
)

REPO = Path(__file__).resolve().parents[2]


def card_data(**overrides) -> DPModelCardData:
    values = dict(
        epsilons={"rdp": 7.98749, "prv": 6.83388, "gdp": 5.80307},
        accountant="rdp",
        delta=1.25e-4,
        expected_batch_size=200,
        num_examples=4000,
        max_grad_norm=0.5,
        clipping_mode="bk-mixopt",
        poisson_sampling=True,
        optimizer="AdamW",
        segments=[(0.7415, 0.05, 160)],
    )
    values.update(overrides)
    return DPModelCardData(**values)


def flat(text: str) -> str:
    """Wrapped prose (and block quotes) as one line."""
    return " ".join(line.removeprefix("> ").strip() for line in text.splitlines())


def table(section: str) -> dict[str, str]:
    """The first Markdown table of ``section`` as {first cell: second cell}; checks that every row has two cells."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 2, line
        rows[cells[0]] = cells[1]
    return rows


class TestContent:
    def test_headline_is_a_proven_bound_rounded_up(self):
        for accountant, shown, not_shown in [("rdp", "7.988", "7.987"), ("prv", "6.834", "6.833")]:
            rows = table(render_dp_section(card_data(accountant=accountant)))
            assert rows["Guarantee"] == (
                f"({shown}, 0.000125)-DP under the {accountant.upper()} accountant (a proven upper bound)"
            )
            assert not_shown not in rows["Guarantee"]

    def test_named_column_headers(self):
        section = render_dp_section(card_data())
        assert "| Quantity | Value |\n|---|---|" in section
        assert "| | |" not in section

    def test_gdp_headline_is_refused(self):
        with pytest.raises(ValueError, match="GDP.*estimate.*`accountant`"):
            render_dp_section(card_data(accountant="gdp"))
        with pytest.raises(ValueError, match="unknown|Unknown"):
            render_dp_section(card_data(accountant="pld", epsilons={"pld": 1.0}))
        with pytest.raises(ValueError, match="no entry for the headline accountant 'prv'"):
            render_dp_section(card_data(accountant="prv", epsilons={"rdp": 1.0}))

    def test_gdp_is_labelled_an_estimate_after_the_bounds(self):
        rows = list(table(render_dp_section(card_data())).items())
        labels = [label for label, _ in rows]
        rdp, prv, gdp = (labels.index(f"Epsilon, {n} accountant") for n in ("RDP", "PRV", "GDP (CLT)"))
        assert rdp < prv < gdp  # headline first, then the other bound, then the estimate
        assert rows[gdp][1].startswith("5.803 (estimate, not a bound")
        assert rows[rdp][1] == "7.988 (proven upper bound)" and rows[prv][1] == "6.834 (proven upper bound)"
        assert "5.803" not in dict(rows)["Guarantee"]

    def test_one_segment_keeps_the_single_rows(self):
        rows = table(render_dp_section(card_data()))
        assert rows["Noise multiplier (sigma)"] == "0.7415"
        assert rows["Sample rate (q)"] == "0.05"
        assert rows["Noisy steps"] == "160"
        assert rows["Expected logical batch size"] == "200"
        assert not any(label.startswith("Segment") for label in rows)

    def test_legacy_fields_give_the_same_card(self):
        legacy = card_data(segments=None, noise_multiplier=0.7415, sample_rate=0.05, steps=160)
        assert render_dp_section(legacy) == render_dp_section(card_data())
        with pytest.raises(ValueError, match="Both `segments` and `steps`"):
            render_dp_section(card_data(steps=160))
        with pytest.raises(ValueError, match="`sample_rate`, `steps` missing"):
            render_dp_section(card_data(segments=None, noise_multiplier=1.0))

    def test_segments_render_one_row_each(self):
        rows = table(render_dp_section(card_data(segments=[(0.8, 0.05, 100), (1.1, 0.1, 50)])))
        assert rows["Segment 1 (steps 1-100)"] == "noise multiplier (sigma) 0.8, sample rate (q) 0.05"
        assert rows["Segment 2 (steps 101-150)"] == "noise multiplier (sigma) 1.1, sample rate (q) 0.1"
        assert rows["Noisy steps"] == "150"
        assert rows["Expected logical batch size (q N, per segment)"] == "200, 400"
        assert "Noise multiplier (sigma)" not in rows and "Sample rate (q)" not in rows

    def test_invalid_history_is_refused(self):
        with pytest.raises(ValueError, match="noise_multiplier 0, so epsilon is infinite"):
            render_dp_section(card_data(segments=[(0.0, 0.05, 10)]))
        section = render_dp_section(card_data(segments=[(0.0, 0.05, 10)], epsilons={"rdp": float("inf")}))
        assert (
            table(section)["Guarantee"] == "none: no differential-privacy guarantee (noise multiplier 0, epsilon = inf)"
        )
        with pytest.raises(ValueError, match="sample_rate=1.5"):
            render_dp_section(card_data(segments=[(1.0, 1.5, 10)]))
        with pytest.raises(ValueError, match="`delta` must be in"):
            render_dp_section(card_data(delta=0.0))

    def test_shuffled_batches_claim_no_proven_guarantee(self):
        section = render_dp_section(card_data(poisson_sampling=False))
        rows = table(section)
        assert rows["Guarantee"].startswith("none proven:")
        assert rows["Epsilon, RDP accountant"] == "7.988 (not proven: assumes Poisson sampling)"
        assert "proven upper bound" not in section
        assert "heuristic, not a proven bound" in flat(section)

    def test_optimizer_clipping_and_noise_source(self):
        rows = table(render_dp_section(card_data(optimizer="SGD", clipping_details="automatic, gamma 0.01")))
        assert rows["Optimizer"] == "SGD"
        assert rows["Clipping mode"] == "bk-mixopt" and rows["Clipping details"] == "automatic, gamma 0.01"
        assert rows["Noise source"] == "OS-seeded PRNG (torch), re-seeded at every start; seed never written"
        assert "Clipping details" not in table(render_dp_section(card_data()))
        secure = table(render_dp_section(card_data(secure_mode=True)))
        assert secure["Noise source"] == "cryptographically secure (secure_mode)"

    def test_published_training_metrics(self):
        quiet = render_dp_section(card_data())
        assert "No un-noised statistic of the training data (training loss, token counts, FLOs) was written" in quiet
        assert "[!WARNING]" not in quiet
        loud = render_dp_section(card_data(published_training_metrics=["loss", "num_input_tokens_seen"]))
        warning = flat(loud[loud.index("> [!WARNING]") :].split("\n\n")[0])
        assert "`loss`, `num_input_tokens_seen`" in warning and "NOT covered by the guarantee" in warning
        assert "No un-noised statistic" not in loud
        with pytest.raises(TypeError, match="got str"):
            render_dp_section(card_data(published_training_metrics="loss"))

    def test_evaluation_metrics_sentence_is_always_there(self):
        sentence = "Evaluation metrics reported on this card or in the repository are computed on"
        for data in [card_data(), card_data(published_training_metrics=["loss"])]:
            text = flat(render_dp_section(data))
            assert sentence in text and "not covered by the guarantee" in text

    def test_evaluation_sentence_says_what_was_checked(self):
        unchecked = flat(render_dp_section(card_data()))
        assert (
            "computed on the data given for evaluation, which hf_dp did not compare with the training set" in unchecked
        )
        checked = flat(render_dp_section(card_data(eval_checked=True)))
        assert "compared with the training set by hf_dp: no overlap found" in checked
        assert "did not compare" not in checked and "[!WARNING]" not in checked

    def test_evaluation_on_training_data_is_a_warning(self):
        what = "`eval_dataset` is the training set (the same object)"
        section = render_dp_section(card_data(eval_checked=True, eval_overlap=[what]))
        warning = flat(section[section.index("> [!WARNING]") :])
        assert f"The evaluation data overlaps the training set: {what}." in warning
        assert "Apart from the evaluation metrics (computed on training data: see the warning below), no un-noised" in (
            flat(section)
        )
        assert "were computed, without noise, on training data and are NOT covered by the guarantee" in warning
        assert "no overlap found" not in warning and "choice of the released model" not in warning
        selected = render_dp_section(
            card_data(eval_overlap=["3 of 256 sampled rows"], eval_selection=["load_best_model_at_end=True"])
        )
        assert (
            "load_best_model_at_end=True used these metrics, so the choice of the released model depends on those"
            in flat(selected)
        )
        with pytest.raises(TypeError, match="`eval_overlap` must be a list"):
            render_dp_section(card_data(eval_overlap=what))

    def test_infinite_epsilon_says_no_guarantee(self):
        section = render_dp_section(
            card_data(segments=[(0.0, 0.05, 10)], epsilons={"rdp": float("inf"), "prv": float("inf")})
        )
        intro_warning = flat(section.split("| Quantity")[0])
        assert "This model has no differential-privacy guarantee (noise multiplier 0, epsilon = inf)" in intro_warning
        partly = render_dp_section(card_data(segments=[(1.0, 0.05, 6), (0.0, 0.05, 4)], epsilons={"rdp": math.inf}))
        assert table(partly)["Guarantee"] == (
            "none: no differential-privacy guarantee (noise multiplier 0 for 4 of the 10 steps, epsilon = inf)"
        )
        assert "[!WARNING]" not in render_dp_section(card_data()).split("| Quantity")[0]

    def test_audit_subsection(self):
        audit = {"claimed_epsilon": 3.0, "epsilon_lower_bound": 0.41679, "num_canaries": 1000, "significance": 0.05}
        assert "### Privacy audit" not in render_dp_section(card_data())
        with pytest.raises(ValueError, match=r"lacks the key\(s\) \['delta'\]"):
            render_dp_section(card_data(audit=audit))
        section = render_dp_section(card_data(audit={**audit, "delta": 1e-5, "exposure": 2.5}))
        audit_part = section[section.index("### Privacy audit") :]
        rows = table(audit_part)
        assert rows["Claimed epsilon"] == "3"
        assert rows["Empirical epsilon lower bound"] == "0.4167 (at 95% confidence)"  # a lower bound rounds down
        assert rows["Canaries"] == "1000" and rows["Delta"] == "1e-05" and rows["Exposure"] == "2.5"
        assert "does not prove the claimed upper bound" in flat(audit_part)
        assert "[!WARNING]" not in audit_part
        broken = render_dp_section(card_data(audit={**audit, "delta": 1e-5, "epsilon_lower_bound": 4.2}))
        assert "The empirical lower bound exceeds the claimed epsilon" in flat(broken)

    def test_epsilon_plot_reference(self):
        assert "![" not in render_dp_section(card_data())
        section = render_dp_section(card_data(epsilon_plot="epsilon.png"))
        assert "![Epsilon spent against the optimizer step (RDP accountant)](epsilon.png)" in section
        with pytest.raises(ValueError, match="relative to the card"):
            render_dp_section(card_data(epsilon_plot="/tmp/epsilon.png"))

    def test_format_bound_rounds_away_from_the_claim(self):
        assert format_bound(7.98749) == "7.988" and format_bound(7.98749, upper=False) == "7.987"
        assert format_bound(6.833) == "6.833"  # exact values are not bumped
        assert format_bound(1e-5, digits=3) == "1e-05" and format_bound(1.25e-4, digits=3) == "0.000125"
        assert format_bound(float("inf")) == "inf" and format_bound(0.0) == "0"


class TestEpsilonPlot:
    def test_writes_a_png(self, tmp_path):
        path = tmp_path / "sub" / "epsilon.png"
        assert plot_epsilon_curve([(0, 0.0), (10, 1.2), (20, 1.9)], str(path), accountant="rdp") is True
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_without_matplotlib_returns_false(self, tmp_path, monkeypatch):
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
        monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
        path = tmp_path / "epsilon.png"
        assert plot_epsilon_curve([(0, 0.0), (10, 1.2)], str(path), accountant="prv") is False
        assert not path.exists()

    def test_refuses_what_it_cannot_plot(self, tmp_path):
        with pytest.raises(ValueError, match="empty"):
            plot_epsilon_curve([], str(tmp_path / "e.png"), accountant="rdp")
        with pytest.raises(ValueError, match="finite"):
            plot_epsilon_curve([(0, 0.0), (1, float("inf"))], str(tmp_path / "e.png"), accountant="rdp")
        with pytest.raises(ValueError, match="`accountant`"):
            plot_epsilon_curve([(0, 0.0)], str(tmp_path / "e.png"), accountant="moments")


class TestCardFile:
    def test_creates_a_card_with_tags(self, tmp_path):
        write_dp_model_card(str(tmp_path), render_dp_section(card_data()))
        text = (tmp_path / "README.md").read_text()
        assert text.startswith("---\n") and "- differential-privacy\n- hf-dp\n" in text
        assert text.count("## Differential privacy") == 1

    def test_no_guarantee_tags_replace_a_stale_dp_tag(self, tmp_path):
        write_dp_model_card(str(tmp_path), render_dp_section(card_data()))
        assert card_tags(7.9) == ["differential-privacy", "hf-dp"]
        section = render_dp_section(card_data(segments=[(0.0, 0.05, 10)], epsilons={"rdp": math.inf}))
        write_dp_model_card(str(tmp_path), section, tags=card_tags(math.inf))
        text = (tmp_path / "README.md").read_text()
        assert "- hf-dp\n- no-dp-guarantee\n" in text and "differential-privacy\n" not in text.split("---")[1]

    def test_replaces_an_existing_section_and_keeps_the_rest(self, tmp_path):
        (tmp_path / "README.md").write_text(
            "---\ntags:\n- text-generation\n---\n\n# my-model\n\nIntro.\n\n## Differential privacy\n\nOLD SECTION\n\n"
            "### Old subsection\n\nOLD TOO\n\n## Citation\n\nCite us.\n"
        )
        for steps in (160, 320):  # twice: idempotent, one section
            write_dp_model_card(str(tmp_path), render_dp_section(card_data(segments=[(0.7415, 0.05, steps)])))
        text = (tmp_path / "README.md").read_text()
        assert text.count("## Differential privacy") == 1
        assert "OLD" not in text and "| Noisy steps | 320 |" in text and "| Noisy steps | 160 |" not in text
        assert text.index("Intro.") < text.index("## Differential privacy") < text.index("## Citation\n\nCite us.")
        assert "- text-generation\n- differential-privacy\n- hf-dp\n" in text


class TestTemplate:
    def test_top_level_copy_matches_the_package_template(self):
        top = (REPO / "model_cards" / "dp_model_card.md").read_text(encoding="utf-8")
        assert top == template_text(), (
            "model_cards/dp_model_card.md differs from the packaged hf_dp/release/templates/dp_model_card.md (the "
            "canonical one): edit the package copy, then `cp hf_dp/release/templates/dp_model_card.md model_cards/`."
        )

    def test_template_path_is_a_deprecated_shim(self):
        with pytest.warns(FutureWarning, match="template_text"):
            path = template_path()
        assert path.read_text(encoding="utf-8") == template_text()

    def test_example_rendering_is_up_to_date(self):
        spec = importlib.util.spec_from_file_location("render_example", REPO / "model_cards" / "render_example.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        checked_in = (REPO / "model_cards" / "example_rendered_demo_card.md").read_text(encoding="utf-8")
        assert checked_in.splitlines()[0].startswith("> **Example rendering**")
        assert checked_in == module.render_example(), "Re-render it: python model_cards/render_example.py"
        assert (REPO / "model_cards" / module.PLOT).is_file()

    def test_every_field_is_documented(self):
        doc = DPModelCardData.__doc__
        missing = [f.name for f in dataclasses.fields(DPModelCardData) if f"{f.name} (`" not in doc]
        assert not missing


WHEEL_CHECK = r"""
import importlib, json, os, sys
wheel, target, *site = sys.argv[1:]
assert not any("editable" in repr(f).lower() for f in sys.meta_path), sys.meta_path
results = {}
for name, location in [("zip", wheel), ("target", target)]:
    for mod in [m for m in sys.modules if m == "hf_dp" or m.startswith("hf_dp.")]:
        del sys.modules[mod]
    sys.path[:] = [location, *site] + [p for p in sys.path if p != location and p not in site]
    importlib.invalidate_caches()
    import hf_dp
    from hf_dp.release.model_card import DPModelCardData, render_dp_section, write_dp_model_card
    data = DPModelCardData(
        epsilons={"prv": 2.5, "gdp": 2.1}, accountant="prv", delta=1e-5, expected_batch_size=64, num_examples=1000,
        max_grad_norm=0.1, clipping_mode="bk", poisson_sampling=True, optimizer="AdamW", segments=[(1.0, 0.064, 30)],
    )
    out = os.path.join(os.getcwd(), name)
    write_dp_model_card(out, render_dp_section(data))
    results[name] = {"file": hf_dp.release.model_card.__file__, "card": open(os.path.join(out, "README.md")).read()}
print(json.dumps({"results": results, "sys_path": sys.path}))
"""


def test_built_wheel_ships_the_template(tmp_path):
    """Build a wheel, install it with ``--target``, and render a card from there (and from the zipped wheel itself)
    in an interpreter that sees neither the repository nor the editable install."""
    src = tmp_path / "src"  # a clean copy: an in-tree build reuses a stale build/ and races with other builds
    shutil.copytree(REPO / "hf_dp", src / "hf_dp", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    pip = [sys.executable, "-m", "pip", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist", src],
                   check=True, env=env, cwd=tmp_path)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("hf_dp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hf_dp/release/templates/dp_model_card.md" in names
    assert not [n for n in names if "/share/" in n or ".data/" in n], "no data-files outside the package"
    target = tmp_path / "target"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", target, wheel], check=True, env=env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    site = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    # -I: no PYTHON* variables, no cwd or script dir on sys.path; -S: no site, so the editable install's .pth
    # finder never loads. The venv's site-packages is added after the install, for the dependencies only.
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", WHEEL_CHECK, str(wheel), str(target), *site],
        cwd=elsewhere, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(REPO) not in report["sys_path"] and str(REPO / "hf_dp") not in report["sys_path"]
    assert report["results"]["zip"]["file"].startswith(str(wheel) + os.sep)
    assert report["results"]["target"]["file"].startswith(str(target) + os.sep)
    for result in report["results"].values():
        card = result["card"]
        assert "| Quantity | Value |" in card and "- differential-privacy" in card
        assert "| Guarantee | (2.5, 1e-05)-DP under the PRV accountant (a proven upper bound) |" in card
        assert "| Epsilon, GDP (CLT) accountant | 2.1 (estimate, not a bound" in card


def test_fixed_noise_seed_voids_the_headline():
    section = render_dp_section(card_data(fixed_noise_seed=True))
    rows = table(section)
    assert rows["Guarantee"].startswith("none:") and "noise_seed" in rows["Guarantee"]
    assert "noise_seed" in rows["Noise source"] and "subtract it" in flat(section)
    assert "never written" in table(render_dp_section(card_data()))["Noise source"]
