"""What a tensor payload is refused for: each error has a stable `code` the coordinator reports to clients."""

from __future__ import annotations

from collections.abc import Iterable

from shared.errors import SharedError

__all__ = [
    "DTypeMismatch",
    "MalformedPayload",
    "MissingTensors",
    "NonFiniteValues",
    "PayloadError",
    "PrivateTensorsInPayload",
    "ShapeMismatch",
    "UnexpectedTensors",
]

# * PayloadError            (a shared.errors.SharedError, hence a ValueError)
#   + MalformedPayload        bytes are not a well-formed safetensors file (truncated, bad header)
#   + UnexpectedTensors       names outside the schema
#     - PrivateTensorsInPayload   ... and some of them are a site's private (phi_k) names
#   + MissingTensors          schema names absent from the payload
#   + ShapeMismatch           a tensor's shape differs from the schema
#   + DTypeMismatch           a tensor's dtype differs from the schema
#   + NonFiniteValues         NaN or Inf in a floating tensor


class PayloadError(SharedError):
    """A tensor payload was refused; `code` names the reason, `names` the tensors involved."""

    code = "invalid_payload"

    def __init__(self, message: str, names: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.names = sorted(names)


class MalformedPayload(PayloadError):
    """The bytes are not a well-formed safetensors file (truncated, bad header, bad offsets)."""

    code = "malformed_payload"


class UnexpectedTensors(PayloadError):
    """The payload holds names that the schema does not have."""

    code = "unexpected_tensors"


class PrivateTensorsInPayload(UnexpectedTensors):
    """The payload holds private (phi_k) names: a privacy violation."""

    code = "private_tensors_in_payload"


class MissingTensors(PayloadError):
    """Names of the schema are absent from the payload."""

    code = "missing_tensors"


class ShapeMismatch(PayloadError):
    """A tensor's shape differs from the schema."""

    code = "shape_mismatch"


class DTypeMismatch(PayloadError):
    """A tensor's dtype differs from the schema."""

    code = "dtype_mismatch"


class NonFiniteValues(PayloadError):
    """A floating-point tensor holds NaN or Inf."""

    code = "non_finite_values"
