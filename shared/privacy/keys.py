"""Per-round X25519 key pairs, HKDF-SHA256 key derivation, and AES-256-GCM share ciphertexts.

Each site makes two fresh key pairs per round (Bonawitz et al., CCS 2017, §4): `c` to agree an
AES-GCM key with each neighbour for the Shamir shares it sends through the server, and `s` to
agree the seed of the pairwise mask. Both derivations bind the study, the round and the unordered
pair of sites, so no key or seed is reused across rounds, studies or pairs; the ciphertext's
associated data also binds the direction (sender, receiver), so the server cannot reroute a share.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shared.privacy.errors import ShareDecryptionFailed

__all__ = [
    "KEY_BYTES",
    "RoundKeys",
    "decrypt_share_payload",
    "encrypt_share_payload",
    "mask_seed",
    "private_key_from_bytes",
    "share_encryption_key",
]

KEY_BYTES = 32
_NONCE_BYTES = 12


@dataclass(frozen=True)
class RoundKeys:
    """A site's two key pairs for one round: `cipher` encrypts shares, `mask` agrees pairwise mask seeds."""

    cipher: X25519PrivateKey
    mask: X25519PrivateKey

    @classmethod
    def generate(cls) -> RoundKeys:
        """Two fresh key pairs from the OS random source."""
        return cls(X25519PrivateKey.generate(), X25519PrivateKey.generate())

    def cipher_public(self) -> bytes:
        """The raw 32-byte public key of the share-encryption pair."""
        return self.cipher.public_key().public_bytes_raw()

    def mask_public(self) -> bytes:
        """The raw 32-byte public key of the mask-agreement pair."""
        return self.mask.public_key().public_bytes_raw()

    def mask_private_bytes(self) -> bytes:
        """The raw 32-byte private mask key: the secret a site Shamir-shares in case it drops out."""
        return self.mask.private_bytes_raw()


def private_key_from_bytes(raw: bytes) -> X25519PrivateKey:
    """An X25519 private key from its raw 32 bytes (a reconstructed mask key)."""
    return X25519PrivateKey.from_private_bytes(raw)


def share_encryption_key(
    own: X25519PrivateKey, peer_public: bytes, *, study_uid: str, round_no: int, sites: tuple[int, int]
) -> bytes:
    """The AES-256-GCM key two sites share for this round, from X25519 + HKDF-SHA256."""
    return _derive(own, peer_public, purpose="share-encryption", study_uid=study_uid, round_no=round_no, sites=sites)


def mask_seed(
    own: X25519PrivateKey, peer_public: bytes, *, study_uid: str, round_no: int, sites: tuple[int, int]
) -> bytes:
    """The 32-byte seed of the pairwise mask two sites share for this round, from X25519 + HKDF-SHA256."""
    return _derive(own, peer_public, purpose="pairwise-mask", study_uid=study_uid, round_no=round_no, sites=sites)


def encrypt_share_payload(
    key: bytes, plaintext: bytes, *, study_uid: str, round_no: int, sender: int, receiver: int
) -> bytes:
    """AES-256-GCM under a random 96-bit nonce (prepended); the associated data binds study, round and direction."""
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _associated_data(study_uid, round_no, sender, receiver))


def decrypt_share_payload(
    key: bytes, ciphertext: bytes, *, study_uid: str, round_no: int, sender: int, receiver: int
) -> bytes:
    """Open a share ciphertext; raise ShareDecryptionFailed if anything it is bound to differs."""
    nonce, body = ciphertext[:_NONCE_BYTES], ciphertext[_NONCE_BYTES:]
    try:
        return AESGCM(key).decrypt(nonce, body, _associated_data(study_uid, round_no, sender, receiver))
    except (InvalidTag, ValueError) as exc:
        raise ShareDecryptionFailed(f"share from site {sender} to site {receiver} failed authentication") from exc


def _derive(
    own: X25519PrivateKey, peer_public: bytes, *, purpose: str, study_uid: str, round_no: int, sites: tuple[int, int]
) -> bytes:
    shared_secret = own.exchange(X25519PublicKey.from_public_bytes(peer_public))
    info = json.dumps(["cardiofl-secagg-v1", purpose, study_uid, round_no, sorted(sites)]).encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared_secret)


def _associated_data(study_uid: str, round_no: int, sender: int, receiver: int) -> bytes:
    return json.dumps(["cardiofl-secagg-share-v1", study_uid, round_no, sender, receiver]).encode()
