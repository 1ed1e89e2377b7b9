import pytest

from cardiofl.experiment.fedcvd import FEDCVD_ALGORITHMS, fedcvd_study
from shared.algorithms.registry import ALGORITHMS


def test_the_preset_has_fedcvd_s_settings() -> None:
    config = fedcvd_study("fedprox")
    training = config.training
    assert (training.optimizer, training.lr, training.batch_size, training.local_epochs) == ("sgd", 0.1, 32, 1)
    assert training.momentum == 0.0 and training.weight_decay == 0.0
    assert config.rounds == 50 and config.seed == 42 and config.participation.name == "all"
    assert config.sites == ["sph", "ptbxl", "sxph", "g12ec"] and config.min_sites == 4
    assert config.algorithm.params == {"mu": 0.01} and config.aggregation.name == "equal"
    assert fedcvd_study("ditto").algorithm.params == {"mu": 0.01}
    ala = fedcvd_study("fedala")
    assert ala.algorithm.params["rand_percent"] == 80 and ala.algorithm.params["layer_idx"] == 1
    assert ala.algorithm.params["eta"] == 1.0 and ala.aggregation.name == "samples"
    assert fedcvd_study().aggregation.name == "samples"


def test_the_preset_covers_every_algorithm_and_takes_changes() -> None:
    assert FEDCVD_ALGORITHMS.keys() == ALGORITHMS.keys()
    config = fedcvd_study("scaffold", sites=["a", "b"], rounds=3, model={"preset": "tiny", "heads": "6:2"})
    assert config.rounds == 3 and config.sites == ["a", "b"] and config.model.preset == "tiny"
    with pytest.raises(ValueError, match="no FedCVD preset"):
        fedcvd_study("fedsgd")
