"""Wire models of a secure round's phases, beside shared/wire/protocol.py's tasks and updates.

A site posts one message per phase to its round (`SecureRoundInfo.url` + `/advertisement`,
`/shares`, `/consistency`, `/reveal`) and reads what it needs from `GET` on the same url (`SecureRoundView`). Phase
2's masked vector is an ordinary update upload whose tensors are `MASKED_NARROW` (its Z_{2^32}
section, int32 words; absent when empty) and `MASKED_TENSOR` (its Z_{2^64} section). Keys and
ciphertexts travel as base64, Shamir share values (up to 2^521) as hex.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StrictInt, field_validator

from shared.errors import FormatError, StudyRuleError
from shared.privacy.keys import KEY_BYTES
from shared.privacy.shamir import PRIME
from shared.wire.protocol import UpdateMetrics, _Input, _Output

__all__ = [
    "MASKED_NARROW",
    "MASKED_TENSOR",
    "Advertisement",
    "Consistency",
    "PeerAdvertisement",
    "RelayedShare",
    "Reveal",
    "SealedShare",
    "SecureRoundView",
    "ShareBatch",
    "b64",
    "from_b64",
    "masked_sections",
]

MASKED_TENSOR = "secagg.masked"  # a secure update's masked Z_{2^64} section, as int64 words
MASKED_NARROW = "secagg.masked32"  # and its masked Z_{2^32} section (the model's changes), as int32 words


def masked_sections(narrow_length: int, wide_length: int) -> dict[str, tuple[int, str]]:
    """Tensor name -> (length, "int32" or "int64") of a masked update, in masking order (Z_{2^32} first)."""
    sections = {MASKED_NARROW: (narrow_length, "int32")} if narrow_length else {}
    return {**sections, MASKED_TENSOR: (wide_length, "int64")}


def b64(raw: bytes) -> str:
    """Standard base64 of `raw`."""
    return base64.b64encode(raw).decode()


def from_b64(text: str) -> bytes:
    """Bytes of a standard base64 string; ValueError when it is not one."""
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise FormatError(f"not base64: {exc}") from None


def _public_key(text: str) -> str:
    if len(from_b64(text)) != KEY_BYTES:
        raise FormatError(f"a public key is {KEY_BYTES} bytes")
    return text


def _field_element(text: str) -> str:
    if not 0 < len(text) <= 132 or int(text, 16) >= PRIME:
        raise FormatError("a share value is a hex field element below 2^521 - 1")
    return text


PublicKey = Annotated[str, AfterValidator(_public_key)]
ShareValue = Annotated[str, Field(pattern=r"^[0-9a-f]+$"), AfterValidator(_field_element)]


Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Signature = Annotated[str, Field(pattern=r"^[0-9a-f]{128}$")]  # Ed25519, hex


class Advertisement(_Input):
    """Phase 0: the site's two round keys, the scalars the weighting reads (n_k; H_k in `metrics`), its signature.

    `global_sha256` names the theta^g_{t-1} the site trained from; `signature` is the site's long-term
    key's over all of it in this round attempt (shared.privacy.signing.advertisement_message, whose
    `report` is what the study's weighting reads of `metrics`: shared.study.server_round.weights_read), so
    the coordinator can neither forge nor replay it. The other sites are relayed n_k and that report
    only (PeerAdvertisement), not the rest of `metrics`.
    """

    cipher_public: PublicKey
    mask_public: PublicKey
    num_examples: StrictInt = Field(gt=0)  # n_k
    metrics: UpdateMetrics  # scalars only: counts and histograms go into the masked vector
    train_seconds: float = Field(ge=0, le=1e12)
    global_sha256: Digest
    signature: Signature

    @field_validator("metrics")
    @classmethod
    def _no_statistics(cls, metrics: UpdateMetrics) -> UpdateMetrics:
        if metrics.eval_stats is not None:
            raise StudyRuleError("eval_stats are summed under the masks in a secure round, never sent in the clear")
        return metrics


class SealedShare(_Input):
    """Phase 1: an AES-GCM sealed pair of Shamir shares for one neighbour."""

    receiver: StrictInt = Field(ge=1)
    ciphertext: str = Field(min_length=1, max_length=1024)

    @field_validator("ciphertext")
    @classmethod
    def _base64(cls, text: str) -> str:
        from_b64(text)
        return text


class ShareBatch(_Input):
    """Phase 1: the site's sealed shares, one for each of its neighbours that advertised."""

    shares: list[SealedShare] = Field(max_length=10_000)


class Consistency(_Input):
    """Phase 3: a survivor's signature of the survivor set (and dropped set, and advertisers) it was told."""

    signature: Signature


class Reveal(_Input):
    """Phase 4: the site's shares of the survivors' self-mask seeds and of the dropped sites' mask keys."""

    self_mask_shares: dict[int, ShareValue] = Field(default_factory=dict)
    mask_key_shares: dict[int, ShareValue] = Field(default_factory=dict)


class PeerAdvertisement(_Output):
    """An advertisement as its site signed it (keys, n_k, what the weighting reads, theta^g), relayed in phase 1."""

    site: int  # its number in the round
    cipher_public: str
    mask_public: str
    num_examples: int
    report: dict[str, Any]  # what the study's weighting reads of its metrics (H_k), and no other: its signed report
    global_sha256: str
    signature: str


class RelayedShare(_Output):
    """A sealed share addressed to the reading site, relayed in phase 2."""

    sender: int
    ciphertext: str


class SecureRoundView(_Output):
    """What the calling site may see of a secure round now: its phase and the messages relayed to it."""

    round_id: int
    status: str  # the round's status: open, aggregating, completed, failed, cancelled
    # 0 advertise, 1 share, 2 mask and upload, 3 consistency (sign the survivors), 4 reveal; None once not `open`
    phase: int | None
    deadline: datetime | None  # of the current phase
    peers: list[PeerAdvertisement] = Field(default_factory=list)  # phase >= 1: every site that advertised
    shares: list[RelayedShare] = Field(default_factory=list)  # phase >= 2: shares sent to this site
    survivors: list[int] | None = None  # phases 3 and 4: whose self masks to reveal
    dropped: list[int] | None = None  # phases 3 and 4: whose mask keys to reveal
    signatures: dict[int, str] = Field(default_factory=dict)  # phase 4: the survivors' consistency signatures
    sent: list[int] = Field(default_factory=list)  # the phases this site has sent its message of
