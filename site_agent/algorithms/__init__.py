"""Client algorithms: what a site does in a round, by the names of shared/registry.py ALGORITHMS.

The site agent (site_agent/local_round.py) and the in-process experiment runner dispatch through
CLIENT_ALGORITHMS, so both run the very same code. FedBN and FedPer train exactly as FedAvg;
what makes them differ is which tensors stay local (shared/algorithms/exchange.py).
"""

from __future__ import annotations

from site_agent.algorithms.base import ClientAlgorithm
from site_agent.algorithms.ditto import Ditto
from site_agent.algorithms.fedah import FedAH
from site_agent.algorithms.fedala import FedALA
from site_agent.algorithms.fedavg import FedAvg
from site_agent.algorithms.fedprox import FedProx
from site_agent.algorithms.fedrep import FedRep
from site_agent.algorithms.learned_heads import LearnedHeads
from site_agent.algorithms.scaffold import Scaffold

__all__ = ["CLIENT_ALGORITHMS", "ClientAlgorithm"]

CLIENT_ALGORITHMS: dict[str, ClientAlgorithm] = {
    "fedavg": FedAvg(),
    "fedprox": FedProx(),
    "scaffold": Scaffold(),
    "scaffold_fedcvd": Scaffold(corrects_gradients=False),  # FedCVD's no-op correction
    "ditto": Ditto(),
    "fedala": FedALA(),
    "fedah": FedAH(),
    "fedbn": FedAvg(),  # BatchNorm layers local
    "fedper": FedAvg(),  # classifier local, trained jointly with the body
    "fedrep": FedRep(),
    "learned_heads": LearnedHeads(),
}
