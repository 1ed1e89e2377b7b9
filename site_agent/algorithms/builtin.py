"""The client side of cardiofl's own algorithms, named by shared/algorithms/builtin.py's rules ("module:attribute").

FedBN, FedPer and the local baseline train exactly as FedAvg; what makes them differ is which tensors stay
local (shared/algorithms/exchange.py): under `local` every one does, so a site trains its own model alone.
"""

from __future__ import annotations

from site_agent.algorithms.ditto import Ditto
from site_agent.algorithms.fedah import FedAH
from site_agent.algorithms.fedala import FedALA
from site_agent.algorithms.fedavg import FedAvg
from site_agent.algorithms.fedprox import FedProx
from site_agent.algorithms.fedrep import FedRep
from site_agent.algorithms.learned_heads import LearnedHeads
from site_agent.algorithms.scaffold import Scaffold

FEDAVG = FedAvg()
FEDPROX = FedProx()
SCAFFOLD = Scaffold()
SCAFFOLD_FEDCVD = Scaffold(corrects_gradients=False)  # FedCVD's no-op correction
DITTO = Ditto()
FEDALA = FedALA()
FEDAH = FedAH()
FEDBN = FedAvg()  # BatchNorm layers local
FEDPER = FedAvg()  # classifier local, trained jointly with the body
FEDREP = FedRep()
LOCAL = FedAvg()  # the whole model local: each site trains alone from phi_0
LEARNED_HEADS = LearnedHeads()
