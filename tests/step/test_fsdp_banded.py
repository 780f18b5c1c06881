"""Banded correlated noise under FSDP2 (issue 41): 2 CPU processes, each noising its own shards from its own stream
through the correlated source (the shards keep their shapes from step to step, also when a micro-batch runs with the
whole model), every step recorded, epsilon of ceil(T / b) rounds at q_part."""

import pytest
import torch
from helpers.distributed import launch_two
from test_fsdp import N, _run

from hf_dp.accounting import epsilon


@pytest.mark.parametrize(("per_device", "accumulation"), [(4, 1)])  # the last micro-batch: the whole model
def test_fsdp2_trains_with_banded_noise(tmp_path, single_process, per_device, accumulation):
    result = tmp_path / "r.pt"
    banded = {"noise_mechanism": "banded-toeplitz", "noise_bands": 2}
    launch_two(_run, str(tmp_path / "a"), str(result), 1.0, 3, per_device, accumulation, **banded)
    r = torch.load(result, weights_only=False)
    assert r["is_fsdp"] and r["sharded"] == "DTensor" and r["steps"] == 3
    q_part = 2 * (per_device * accumulation * 2) / N
    assert r["epsilon"] == pytest.approx(epsilon(1.0, q_part, 2, 1 / (2 * N)), rel=1e-12)  # ceil(3 / 2) rounds
    assert any(not torch.equal(r["after"][k], r["before"][k]) for k in r["after"])
