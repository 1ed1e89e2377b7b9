"""A whole SecAgg+ round in one process, with sites dropping out at chosen phases."""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from shared.privacy.client import ClientState
from shared.privacy.masking import RingVector
from shared.privacy.messages import RoundSetup
from shared.privacy.quantize import FixedPoint
from shared.privacy.server import ServerState
from shared.privacy.signing import RoundContext, SiteIdentity

__all__ = ["SecureSum", "WeightedSum", "simulate_round", "simulate_secure_sum"]


@dataclass(frozen=True, eq=False)
class SecureSum:
    """The unmasked ring sum and the sites whose inputs it contains."""

    ring_sum: RingVector  # one array, or the sections the inputs had
    survivors: frozenset[int]


@dataclass(frozen=True, eq=False)
class WeightedSum:
    """sum over survivors k of w_k * x_k, decoded, with the largest quantisation error per coordinate."""

    weighted_sum: np.ndarray
    survivors: frozenset[int]
    error_bound: float


def simulate_secure_sum(
    ring_inputs: Mapping[int, RingVector],
    *,
    study_uid: str = "simulation",
    round_no: int = 0,
    dropped_after_advertise: Collection[int] = (),
    dropped_after_sharing: Collection[int] = (),
    dropped_after_masking: Collection[int] = (),
    neighbour_count: int | None = None,
    threshold: int | None = None,
    min_survivors: int | None = None,
    quorum: int | None = None,
    graph_seed: bytes | None = None,
    signed: bool = False,
) -> SecureSum:
    """Run every phase between real ClientStates and a ServerState; a dropped site sends nothing from then on.

    A site in `dropped_after_masking` sent its masked input but neither signs the survivor set nor
    reveals shares: its input is in the sum and the others' shares must still reach the threshold.
    With `signed`, every site gets a signing identity and every message is signed and checked.
    """
    sites = sorted(ring_inputs)
    identities = {site: SiteIdentity.generate() for site in sites} if signed else {}
    setup = RoundSetup.create(
        study_uid=study_uid,
        round_no=round_no,
        sites=sites,
        graph_seed=graph_seed if graph_seed is not None else secrets.token_bytes(32),
        neighbour_count=neighbour_count,
        threshold=threshold,
        min_survivors=min_survivors,
        quorum=quorum,
        signing_keys={site: identity.public_bytes() for site, identity in identities.items()},
        context=RoundContext(study_uid, round_no, 1, "0" * 64) if signed else None,
    )
    server = ServerState(setup)
    clients = {site: ClientState(setup, site, identity=identities.get(site)) for site in setup.sites}
    for client in clients.values():
        server.receive_advertisement(client.advertise())

    sharing = [s for s in setup.sites if s not in dropped_after_advertise]
    relayed = server.advertisements()
    for site in sharing:
        server.receive_shares(site, clients[site].share_secrets(relayed))

    masking = [s for s in sharing if s not in dropped_after_sharing]
    routed = {site: server.shares_for(site) for site in masking}
    for site in masking:
        server.receive_masked_input(clients[site].mask_input(ring_inputs[site], routed[site]))

    request = server.unmask_request()
    revealing = sorted(request.survivors - set(dropped_after_masking))
    for site in revealing:
        server.receive_consistency(site, clients[site].sign_consistency(request))
    signatures = server.consistency_signatures()
    for site in revealing:
        server.receive_reveal(clients[site].reveal_shares(request, signatures))
    return SecureSum(server.unmasked_sum(), request.survivors)


def simulate_round(
    inputs: Mapping[int, np.ndarray],
    weights: Mapping[int, float],
    *,
    dropped_after_advertise: Collection[int] = (),
    dropped_after_sharing: Collection[int] = (),
    dropped_after_masking: Collection[int] = (),
    fixed_point: FixedPoint | None = None,
    study_uid: str = "simulation",
    round_no: int = 0,
    neighbour_count: int | None = None,
    threshold: int | None = None,
    min_survivors: int | None = None,
    quorum: int | None = None,
    graph_seed: bytes | None = None,
    signed: bool = False,
) -> WeightedSum:
    """Securely sum w_k * x_k over the sites that survive, each encoded with `fixed_point` (default f = 24)."""
    encoding = fixed_point if fixed_point is not None else FixedPoint()
    ring_inputs = {site: encoding.encode(np.asarray(x, dtype=np.float64) * weights[site]) for site, x in inputs.items()}
    result = simulate_secure_sum(
        ring_inputs,
        study_uid=study_uid,
        round_no=round_no,
        dropped_after_advertise=dropped_after_advertise,
        dropped_after_sharing=dropped_after_sharing,
        dropped_after_masking=dropped_after_masking,
        neighbour_count=neighbour_count,
        threshold=threshold,
        min_survivors=min_survivors,
        quorum=quorum,
        graph_seed=graph_seed,
        signed=signed,
    )
    assert isinstance(result.ring_sum, np.ndarray)
    return WeightedSum(encoding.decode(result.ring_sum), result.survivors, encoding.error_bound(len(result.survivors)))
