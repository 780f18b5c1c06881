"""KNOWN_GAPS names real configurations, so a typo cannot silently turn a strict xfail into nothing."""

import test_fastdp_layers
import test_opacus_grad_sample_spaces
import test_private_transformers_models
import test_silent_classes
from harness import MODES, node_id
from known_gaps import KNOWN_GAPS


def test_every_known_gap_names_a_configuration():
    ids = set()
    for module in (
        test_opacus_grad_sample_spaces,
        test_fastdp_layers,
        test_private_transformers_models,
        test_silent_classes,
    ):
        for config_id in module.CONFIGS:
            ids |= {config_id} | {node_id(config_id, mode) for mode in MODES}
    unknown = sorted(set(KNOWN_GAPS) - ids)
    assert not unknown, f"KNOWN_GAPS keys that are no configuration: {unknown}"
    assert all(reason.strip() and "\n" not in reason for reason in KNOWN_GAPS.values())


def test_configuration_ids_are_unique_across_files():
    seen: dict[str, str] = {}
    for module in (
        test_opacus_grad_sample_spaces,
        test_fastdp_layers,
        test_private_transformers_models,
        test_silent_classes,
    ):
        for config_id in module.CONFIGS:
            assert config_id not in seen, f"{config_id} is in {seen.get(config_id)} and {module.__name__}"
            seen[config_id] = module.__name__
