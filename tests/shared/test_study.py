import pytest
import torch

from shared.model import build_model, preset
from shared.partition import model_partition, model_schema
from shared.protocol import StudyConfig
from shared.study import initial_state, select_participants, shared_schema, study_partition


@pytest.fixture()
def config() -> StudyConfig:
    return StudyConfig(model={"preset": "tiny", "heads": "6:2"}, sites=["lyon", "oslo", "graz"], seed=11)


def test_fedavg_keeps_the_model_partition(config: StudyConfig) -> None:
    assert study_partition(config) == model_partition(preset("tiny", "6:2"))


def test_shared_schema_is_theta_g_only(config: StudyConfig) -> None:
    schema = shared_schema(config)
    full = model_schema(preset("tiny", "6:2"))
    assert set(schema) == set(model_partition(preset("tiny", "6:2")).shared)
    assert all(schema[name] == full[name] for name in schema)
    assert not any(".local_branch.in_proj" in name or ".local_branch.out_proj" in name for name in schema)


def test_initial_state_is_the_seeded_model_split(config: StudyConfig) -> None:
    shared, local = initial_state(config)
    reference = build_model(preset("tiny", "6:2"), seed=11).state_dict()
    assert shared.keys() == shared_schema(config).keys()
    assert set(local) == set(study_partition(config).local)
    assert all(torch.equal(t, reference[name]) for name, t in {**shared, **local}.items())


def test_all_participation_selects_every_site_with_load_one(config: StudyConfig) -> None:
    assert select_participants(config, 1) == {"lyon": 1.0, "oslo": 1.0, "graz": 1.0}
