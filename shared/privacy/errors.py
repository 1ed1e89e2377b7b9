"""Errors of secure aggregation and differential privacy: two subtrees of shared.errors' one tree.

The tree::

    * SharedError (shared.errors, a ValueError)
      + PrivacyError
        - BelowThreshold          too few sites or shares remain to unmask the sum
          . NotEnoughShares       fewer distinct Shamir shares than the threshold
        - ShareDecryptionFailed   a share ciphertext was altered, misaddressed or from another round
        - ValueOutOfRange         a value cannot be encoded in the ring without risking wrap-around
        - ProtocolViolation       a message arrived out of order, twice, or from a site not in the round
      + PrivacyInputError (shared.errors) parameters or inputs the privacy code cannot work with
        - SetupError              a study's secure-aggregation settings cannot work; names the setting

Why PrivacyError is a ValueError, and PrivacyInputError no PrivacyError: see shared/errors.py.
"""

from __future__ import annotations

from shared.errors import PrivacyInputError, SharedError

__all__ = [
    "BelowThreshold",
    "NotEnoughShares",
    "PrivacyError",
    "ProtocolViolation",
    "SetupError",
    "ShareDecryptionFailed",
    "ValueOutOfRange",
]


class PrivacyError(SharedError):
    """Base for every error of the privacy package."""


class BelowThreshold(PrivacyError):
    """Too few sites or shares remain to unmask the sum; the round's aggregate is lost, nothing leaks."""


class NotEnoughShares(BelowThreshold):
    """Fewer distinct Shamir shares than the threshold were given, so the secret stays hidden."""


class ShareDecryptionFailed(PrivacyError):
    """A share ciphertext failed authentication: altered, misaddressed, or from another study or round."""


class ValueOutOfRange(PrivacyError):
    """A value is non-finite or too large to encode in the ring without the sum wrapping around."""


class ProtocolViolation(PrivacyError):
    """A message arrived in the wrong phase, twice, or names a site that is not in the round."""


class SetupError(PrivacyInputError):
    """A study's secure-aggregation settings cannot work; `field` is the setting's path in the study's terms."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
