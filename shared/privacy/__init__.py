"""Secure aggregation (SecAgg+) and client-level differential privacy (DP-FedAvg), as a pure library.

Nothing here sends a message: the client and server states produce and consume plain data that
the coordinator relays. Modules, lowest first: errors, shamir, prg, quantize, vectors, keys,
graph, masking, messages, client, server, simulate; dp and accounting for differential privacy.
"""

from shared.privacy.accounting import (
    Accountant,
    PrivacyBudget,
    epsilon_spent,
    require_budget_for_next_round,
    would_exceed_budget,
)
from shared.privacy.client import ClientState
from shared.privacy.dp import (
    AdaptiveClipping,
    ClippedUpdate,
    NoiseSource,
    SecureGaussian,
    add_gaussian_noise,
    central_noise_std,
    clip_update,
    distributed_noise_std,
    effective_noise_multiplier,
    global_l2_norm,
    model_delta,
    update_noise_multiplier,
)
from shared.privacy.errors import (
    BelowThreshold,
    BudgetExceeded,
    NotEnoughShares,
    PrivacyError,
    ProtocolViolation,
    ShareDecryptionFailed,
    ValueOutOfRange,
)
from shared.privacy.graph import default_neighbour_count, default_threshold, neighbour_graph
from shared.privacy.messages import (
    EncryptedShare,
    KeyAdvertisement,
    MaskedInput,
    RoundSetup,
    ShareReveal,
    UnmaskRequest,
)
from shared.privacy.quantize import COUNTS, FixedPoint
from shared.privacy.server import ServerState
from shared.privacy.simulate import SecureSum, WeightedSum, simulate_round, simulate_secure_sum
from shared.privacy.vectors import TensorLayout, flatten, unflatten

__all__ = [
    "COUNTS",
    "Accountant",
    "AdaptiveClipping",
    "BelowThreshold",
    "BudgetExceeded",
    "ClientState",
    "ClippedUpdate",
    "EncryptedShare",
    "FixedPoint",
    "KeyAdvertisement",
    "MaskedInput",
    "NoiseSource",
    "NotEnoughShares",
    "PrivacyBudget",
    "PrivacyError",
    "ProtocolViolation",
    "RoundSetup",
    "SecureGaussian",
    "SecureSum",
    "ServerState",
    "ShareDecryptionFailed",
    "ShareReveal",
    "TensorLayout",
    "UnmaskRequest",
    "ValueOutOfRange",
    "WeightedSum",
    "add_gaussian_noise",
    "central_noise_std",
    "clip_update",
    "default_neighbour_count",
    "default_threshold",
    "distributed_noise_std",
    "effective_noise_multiplier",
    "epsilon_spent",
    "flatten",
    "global_l2_norm",
    "model_delta",
    "neighbour_graph",
    "require_budget_for_next_round",
    "simulate_round",
    "simulate_secure_sum",
    "unflatten",
    "update_noise_multiplier",
    "would_exceed_budget",
]
