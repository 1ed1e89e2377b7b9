"""Wire models of a secure round's phases (protocol 4), beside shared/wire/protocol.py's tasks and updates.

A site posts one message per phase to its round (`SecureRoundInfo.url` + `/advertisement`,
`/shares`, `/reveal`) and reads what it needs from `GET` on the same url (`SecureRoundView`). Phase
2's masked vector is an ordinary update upload whose only tensor is `MASKED_TENSOR`. Keys and
ciphertexts travel as base64, Shamir share values (up to 2^521) as hex.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, Field, StrictInt, field_validator

from shared.errors import FormatError, StudyRuleError
from shared.privacy.keys import KEY_BYTES
from shared.privacy.shamir import PRIME
from shared.wire.protocol import UpdateMetrics, _Input, _Output

__all__ = [
    "MASKED_TENSOR",
    "Advertisement",
    "PeerKeys",
    "RelayedShare",
    "Reveal",
    "SealedShare",
    "SecureRoundView",
    "ShareBatch",
    "b64",
    "from_b64",
]

MASKED_TENSOR = "secagg.masked"  # the one tensor of a secure update: the masked ring vector as int64 words


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


class Advertisement(_Input):
    """Phase 0: the site's two public keys, and the scalars the weighting needs (n_k; H_k in `metrics`)."""

    cipher_public: PublicKey
    mask_public: PublicKey
    num_examples: StrictInt = Field(gt=0)  # n_k
    metrics: UpdateMetrics  # scalars only: counts and histograms go into the masked vector
    train_seconds: float = Field(ge=0, le=1e12)

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


class Reveal(_Input):
    """Phase 3: the site's shares of the survivors' self-mask seeds and of the dropped sites' mask keys."""

    self_mask_shares: dict[int, ShareValue] = Field(default_factory=dict)
    mask_key_shares: dict[int, ShareValue] = Field(default_factory=dict)


class PeerKeys(_Output):
    """A neighbour's public keys, relayed in phase 1."""

    site: int
    cipher_public: str
    mask_public: str


class RelayedShare(_Output):
    """A sealed share addressed to the reading site, relayed in phase 2."""

    sender: int
    ciphertext: str


class SecureRoundView(_Output):
    """What the calling site may see of a secure round now: its phase and the messages relayed to it."""

    round_id: int
    status: str  # the round's status: open, aggregating, completed, failed, cancelled
    phase: int | None  # 0 advertise, 1 share, 2 mask and upload, 3 reveal; None once the round left `open`
    deadline: datetime | None  # of the current phase
    weight: float | None = None  # w_k, fixed when phase 0 closed (None: this site did not advertise in time)
    peers: list[PeerKeys] = Field(default_factory=list)  # phase >= 1: neighbours that advertised
    shares: list[RelayedShare] = Field(default_factory=list)  # phase >= 2: shares sent to this site
    survivors: list[int] | None = None  # phase 3: whose self masks to reveal
    dropped: list[int] | None = None  # phase 3: whose mask keys to reveal
    sent: list[int] = Field(default_factory=list)  # the phases this site has sent its message of
