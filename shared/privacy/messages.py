"""The round setup and the messages of one secure-aggregation round, as plain data the server relays."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from shared.errors import PrivacyInputError
from shared.privacy.graph import default_neighbour_count, default_threshold, neighbour_graph, signature_quorum
from shared.privacy.shamir import PRIME, SHARE_BYTES, Share
from shared.privacy.signing import RoundContext, advertisement_message

__all__ = [
    "EncryptedShare",
    "KeyAdvertisement",
    "MaskedInput",
    "RoundSetup",
    "ShareReveal",
    "SharedSecrets",
    "UnmaskRequest",
]


@dataclass(frozen=True)
class RoundSetup:
    """What every party knows before a round: who takes part, the public graph seed and the thresholds.

    Sites are numbered 1..K (for instance in sorted order of their uids); a site's number is also
    the point of the Shamir shares it holds. See graph.py for the default parameters.
    `signature_quorum` is how many valid consistency signatures on one survivor and advertiser set a
    survivor needs before it reveals (in a signed round).

    With `signing_keys` (each site's long-term Ed25519 public key, by number) and `context` the
    round is run against a malicious server: advertisements and the consistency check are signed
    (signing.py) and verified by every party. Without them (an in-process simulation, with no
    server to distrust) nothing is signed.
    """

    study_uid: str
    round_no: int
    sites: tuple[int, ...]
    graph_seed: bytes
    neighbour_count: int
    threshold: int
    min_survivors: int
    signature_quorum: int
    signing_keys: Mapping[int, bytes] = field(default_factory=dict, compare=False)
    context: RoundContext | None = None

    @classmethod
    def create(
        cls,
        *,
        study_uid: str,
        round_no: int,
        sites: Sequence[int],
        graph_seed: bytes,
        neighbour_count: int | None = None,
        threshold: int | None = None,
        min_survivors: int | None = None,
        quorum: int | None = None,
        signing_keys: Mapping[int, bytes] | None = None,
        context: RoundContext | None = None,
    ) -> RoundSetup:
        """A setup with the defaults of a server colluding with no site for whatever is not given (graph.py)."""
        ordered = tuple(sorted(sites))
        count = neighbour_count if neighbour_count is not None else default_neighbour_count(len(ordered))
        t = threshold if threshold is not None else default_threshold(count)
        signatures = quorum if quorum is not None else min(signature_quorum(len(ordered), 0), len(ordered))
        survivors = min_survivors if min_survivors is not None else min(max(t + 1, signatures), len(ordered))
        return cls(
            study_uid, round_no, ordered, graph_seed, count, t, survivors, signatures, dict(signing_keys or {}), context
        )

    @property
    def label(self) -> str:
        """The round as people name it: its number and attempt when signed, else the round number."""
        if self.context is not None:
            return f"round {self.context.round}, attempt {self.context.attempt}"
        return f"round {self.round_no}"

    def __post_init__(self) -> None:
        if len(set(self.sites)) != len(self.sites) or any(not 1 <= s < 2**31 for s in self.sites):
            raise PrivacyInputError("sites must be distinct integers in [1, 2^31)")
        if not 1 <= self.threshold <= self.neighbour_count:
            raise PrivacyInputError(
                f"threshold {self.threshold} must lie in [1, neighbour_count={self.neighbour_count}]"
            )
        if not 1 <= self.min_survivors <= len(self.sites):
            raise PrivacyInputError(f"min_survivors {self.min_survivors} must lie in [1, {len(self.sites)}]")
        if not 1 <= self.signature_quorum <= len(self.sites):
            raise PrivacyInputError(f"signature_quorum {self.signature_quorum} must lie in [1, {len(self.sites)}]")
        if self.signing_keys and (set(self.signing_keys) != set(self.sites) or self.context is None):
            raise PrivacyInputError("a signed round names every site's signing key, and its context")

    @property
    def signed(self) -> bool:
        """Whether advertisements and the consistency check are signed (a round against a malicious server)."""
        return bool(self.signing_keys)

    @cached_property
    def graph(self) -> dict[int, frozenset[int]]:
        """Every site's neighbours for this round."""
        return neighbour_graph(self.sites, neighbour_count=self.neighbour_count, seed=self.graph_seed)

    def neighbours(self, site: int) -> frozenset[int]:
        """The sites `site` shares secrets and masks with."""
        return self.graph[site]


@dataclass(frozen=True)
class KeyAdvertisement:
    """Phase 0, site -> every site: the two public keys of this round, what the weighting reads, its signature.

    `num_examples` and `report` (the scalars the study's weighting reads, e.g. H_k) let every site
    compute every weight itself; `global_digest` names the theta^g the site trained from; in a signed
    round, `signature` is the site's long-term key's over all of it (signing.advertisement_message).
    """

    site: int
    cipher_public: bytes
    mask_public: bytes
    num_examples: int = 0
    report: Mapping[str, object] = field(default_factory=dict, compare=False)
    global_digest: str = ""
    signature: bytes = b""

    def message(self, context: RoundContext) -> bytes:
        """The bytes its signature is over."""
        return advertisement_message(
            context, self.site, self.cipher_public, self.mask_public, self.num_examples, self.report, self.global_digest
        )


@dataclass(frozen=True)
class EncryptedShare:
    """Phase 1, site -> one neighbour through the server: an AES-GCM sealed SharedSecrets."""

    sender: int
    receiver: int
    ciphertext: bytes


@dataclass(frozen=True, eq=False)
class MaskedInput:
    """Phase 2, site -> server: the site's ring vector plus its masks (one array, or its sections)."""

    site: int
    vector: np.ndarray | Sequence[np.ndarray]  # masking.RingVector: sections masked in place stay a list


@dataclass(frozen=True)
class UnmaskRequest:
    """Phases 3 and 4, server -> survivors: reveal self-mask shares of `survivors` and mask-key shares of `dropped`.

    In a signed round each survivor first signs the request it was told (phase 3, consistency), and
    reveals (phase 4) only when at least `signature_quorum` survivors' signatures agree on it.
    """

    survivors: frozenset[int]
    dropped: frozenset[int]


@dataclass(frozen=True)
class ShareReveal:
    """Phase 4, survivor -> server: the shares it holds, keyed by the site whose secret they share."""

    site: int
    self_mask_shares: Mapping[int, Share] = field(default_factory=dict)
    mask_key_shares: Mapping[int, Share] = field(default_factory=dict)


_HEADER = struct.Struct(">II")


@dataclass(frozen=True)
class SharedSecrets:
    """The plaintext of an EncryptedShare: the holder's shares of the owner's self-mask seed and mask key."""

    owner: int
    holder: int
    self_mask_share: int
    mask_key_share: int

    def to_bytes(self) -> bytes:
        """Owner and holder as two big-endian uint32, then each share value as SHARE_BYTES bytes."""
        return (
            _HEADER.pack(self.owner, self.holder)
            + self.self_mask_share.to_bytes(SHARE_BYTES, "big")
            + self.mask_key_share.to_bytes(SHARE_BYTES, "big")
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> SharedSecrets:
        """Parse to_bytes' layout; refuse anything of the wrong length or out of the field."""
        if len(raw) != _HEADER.size + 2 * SHARE_BYTES:
            raise PrivacyInputError(f"shared secrets are {_HEADER.size + 2 * SHARE_BYTES} bytes, got {len(raw)}")
        owner, holder = _HEADER.unpack_from(raw)
        body = raw[_HEADER.size :]
        self_mask = int.from_bytes(body[:SHARE_BYTES], "big")
        mask_key = int.from_bytes(body[SHARE_BYTES:], "big")
        if self_mask >= PRIME or mask_key >= PRIME:
            raise PrivacyInputError("share value outside the field")
        return cls(owner, holder, self_mask, mask_key)
