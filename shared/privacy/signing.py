"""Long-term site identities: Ed25519 keys that sign a secure round's advertisements and its consistency check.

Against a malicious server (Bonawitz et al., CCS 2017, §4; Bell et al., CCS 2020): every site holds
one signing key for life, whose public half the study's terms name, so a server cannot substitute a
site's round keys (an advertisement it forged fails its signature) nor tell survivors different
stories about who survived (each survivor signs the one set it was told, and reveals nothing unless
at least the signature quorum of them agree with it). The signed bytes are canonical JSON naming the study, round,
attempt and theta^g's digest, so no signature is ever valid in another round or attempt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.errors import PrivacyInputError

__all__ = [
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "RoundContext",
    "SiteIdentity",
    "advertisement_message",
    "advertisers_digest",
    "consistency_message",
    "fingerprint",
    "verify",
]

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
_PRIVATE_KEY_BYTES = 32


@dataclass(frozen=True)
class RoundContext:
    """What every signature of a round names: the study, the round and its attempt, and theta^g_{t-1}'s digest."""

    study_uid: str
    round: int
    attempt: int
    global_digest: str  # sha256 hex of the model every site trained from


class SiteIdentity:
    """A site's long-term Ed25519 signing key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> SiteIdentity:
        """A fresh identity from the operating system's randomness."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> SiteIdentity:
        """The identity whose private key is `raw` (32 bytes)."""
        if len(raw) != _PRIVATE_KEY_BYTES:
            raise PrivacyInputError(f"an Ed25519 private key is {_PRIVATE_KEY_BYTES} bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        """The private key's raw 32 bytes (kept only in the site's encrypted store)."""
        return self._key.private_bytes_raw()

    def public_bytes(self) -> bytes:
        """The public key's raw 32 bytes."""
        return self._key.public_key().public_bytes_raw()

    def public_hex(self) -> str:
        """The public key as 64 hex digits: what the coordinator registers and a study's terms name."""
        return self.public_bytes().hex()

    def sign(self, message: bytes) -> bytes:
        """The Ed25519 signature of `message` (64 bytes)."""
        return self._key.sign(message)


def verify(public: bytes, message: bytes, signature: bytes) -> bool:
    """Whether `signature` is `public`'s valid Ed25519 signature of `message`."""
    if len(public) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except InvalidSignature:
        return False
    return True


def fingerprint(public_hex: str) -> str:
    """A short, comparable name of a public key: the first 16 hex digits of its sha256 (for people)."""
    return hashlib.sha256(bytes.fromhex(public_hex)).hexdigest()[:16]


def _canonical(*parts: object) -> bytes:
    return json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()


def advertisement_message(
    context: RoundContext,
    site: int,
    cipher_public: bytes,
    mask_public: bytes,
    num_examples: int,
    report: Mapping[str, object],
    global_digest: str,
) -> bytes:
    """What a site signs in phase 0: its round keys, what the weighting reads and the theta^g it trained from.

    The study, round and attempt are the verifier's `context`'s; theta^g's digest is the one the
    site names, so a verifier tells a forged advertisement from one of another model.
    """
    return _canonical(
        "cardiofl-secagg-advertisement-v1",
        context.study_uid,
        context.round,
        context.attempt,
        global_digest,
        site,
        cipher_public.hex(),
        mask_public.hex(),
        num_examples,
        dict(report),
    )


def advertisers_digest(advertisers: Sequence[tuple[int, int, Mapping[str, object]]]) -> str:
    """The sha256 of who advertised and what each told the weighting: (site, n_k, report), by site."""
    return hashlib.sha256(_canonical(*sorted((site, n, dict(r)) for site, n, r in advertisers))).hexdigest()


def consistency_message(
    context: RoundContext, survivors: frozenset[int], dropped: frozenset[int], advertisers: str
) -> bytes:
    """What a survivor signs before it reveals: the one survivor set (and dropped set) it was told, and the advertisers.

    `advertisers` is `advertisers_digest` of the advertisements the site verified: signed together, a
    server cannot give sites different advertiser sets (hence different weights) unseen either.
    """
    return _canonical(
        "cardiofl-secagg-consistency-v1",
        context.study_uid,
        context.round,
        context.attempt,
        context.global_digest,
        sorted(survivors),
        sorted(dropped),
        advertisers,
    )
