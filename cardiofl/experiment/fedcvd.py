"""FedCVD's Fed-ECG protocol as a study preset (papers/fedcvd-spec.md §3-§5).

Plain SGD with lr 0.1, batch 32, one local epoch per round, 50 rounds, every client every round,
seed 42, and per algorithm FedCVD's hyper-parameters and server mean: sample-weighted for FedAvg
and FedALA, unweighted for FedProx, Scaffold, Ditto and FedBN. FedAH, FedPer and FedRep are not
in FedCVD; they get their own code's defaults and PFLlib's sample-weighted mean. FedCVD averages the
whole state_dict, BatchNorm statistics included, so its FedALA does too (`bn_statistics`); its
FedALA learns W in eval mode, and its FedBN keeps only the BatchNorms its "bn" name filter matches.
`scaffold_fedcvd` is FedCVD's Scaffold as shipped (no client correction); FedPer and FedRep keep
BatchNorm statistics local (PFLlib exchanges parameters only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.study.checks import checked_terms
from shared.terms import StudyTerms

__all__ = ["FEDCVD_ALGORITHMS", "FEDCVD_SITES", "fedcvd_study"]

FEDCVD_SITES = ("sph", "ptbxl", "sxph", "g12ec")  # Fed-ECG's four clients

# name -> (algorithm params, aggregation weighting)
FEDCVD_ALGORITHMS: dict[str, tuple[dict[str, Any], str]] = {
    "fedavg": ({}, "samples"),
    "fedprox": ({"mu": 0.01}, "equal"),
    "scaffold": ({"server_lr": 1.0}, "equal"),
    "scaffold_fedcvd": ({"server_lr": 1.0}, "equal"),  # FedCVD's as shipped: no client correction
    "ditto": ({"mu": 0.01}, "equal"),
    "fedala": (
        {
            "eta": 1.0,
            "rand_percent": 80,
            "layer_idx": 1,
            "threshold": 0.1,
            "num_pre_loss": 10,
            "bn_statistics": "averaged",
            "weight_learning_mode": "eval",
        },
        "samples",
    ),
    "fedbn": ({"local_batchnorm": "bn_named"}, "equal"),
    "fedah": ({"eta": 1.0, "plocal_epochs": 1, "eta_is_local_lr": False}, "samples"),
    "fedper": ({"bn_statistics": "local"}, "samples"),
    "fedrep": ({"plocal_epochs": 1, "bn_statistics": "local"}, "samples"),
    "learned_heads": ({"gate_penalty": 0.01}, "samples"),  # not FedCVD's: its protocol, run with cardiofl's method
    "local": ({}, "samples"),  # each site alone under FedCVD's protocol; the weights weigh nothing
}


def fedcvd_study(algorithm: str = "fedavg", *, sites: Sequence[str] = FEDCVD_SITES, **changes: Any) -> StudyTerms:
    """A study config with FedCVD's settings for `algorithm`; `changes` override any top-level field."""
    if algorithm not in FEDCVD_ALGORITHMS:
        raise ValueError(f"no FedCVD preset for algorithm {algorithm!r}; choose one of {sorted(FEDCVD_ALGORITHMS)}")
    params, weighting = FEDCVD_ALGORITHMS[algorithm]
    config: dict[str, Any] = {
        "training": {
            "optimizer": "sgd",
            "lr": 0.1,
            "momentum": 0.0,
            "weight_decay": 0.0,
            "batch_size": 32,
            "local_epochs": 1,
        },
        "algorithm": {"name": algorithm, "params": params},
        "aggregation": {"name": weighting},
        "participation": {"name": "all"},
        "rounds": 50,
        "seed": 42,
        "sites": list(sites),
        "min_sites": len(sites),
    }
    return checked_terms({**config, **changes})
