"""``hf-dp-epsilon``: proven bounds first, GDP last and labelled an estimate, never a calibrated sigma."""

import pytest

from hf_dp.accounting import epsilon, noise_multiplier
from hf_dp.accounting.cli import main

ARGS = ["--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5"]


def run(capsys, *argv):
    code = main([*argv, *ARGS])
    out = capsys.readouterr()
    return code, [line.split("\t") for line in out.out.strip().splitlines()], out.err


def test_epsilon(capsys):
    code, lines, _ = run(capsys, "--noise-multiplier", "1.0")
    assert code == 0
    assert [line[0] for line in lines] == ["prv", "rdp", "gdp"]
    assert [line[2] for line in lines] == ["upper bound", "upper bound", "estimate, not a bound"]
    for name, value, _ in lines:
        assert float(value.removeprefix("epsilon=")) == pytest.approx(epsilon(1.0, 0.01, 1000, 1e-5, name), abs=1e-4)


def test_order_does_not_follow_the_command_line(capsys):
    _, lines, _ = run(capsys, "--noise-multiplier", "1.0", "--accountants", "gdp", "rdp")
    assert [line[0] for line in lines] == ["rdp", "gdp"]


def test_target_epsilon(capsys):
    code, lines, _ = run(capsys, "--target-epsilon", "3", "--accountants", "gdp", "rdp")
    assert code == 0
    assert [line[0] for line in lines] == ["rdp", "gdp"]
    sigma = noise_multiplier(3.0, 1e-5, 0.01, 1000, "rdp")
    assert lines[0][1] == f"noise_multiplier={sigma:.4f}" and lines[0][2] == "upper bound"
    # GDP: its estimate at the proven sigma, never a sigma of its own.
    gdp_value = epsilon(sigma, 0.01, 1000, 1e-5, "gdp")
    assert lines[1][1] == f"epsilon={gdp_value:.4f} at noise_multiplier={sigma:.4f} (rdp)"
    assert lines[1][2] == "estimate, not a bound"


def test_target_epsilon_gdp_alone_is_refused(capsys):
    code, lines, err = run(capsys, "--target-epsilon", "3", "--accountants", "gdp")
    assert code == 2 and lines == [] and "cannot calibrate" in err


def test_help_documents_gdp(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "estimate, not a bound" in capsys.readouterr().out
