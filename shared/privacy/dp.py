"""Client-level differential privacy: DP-FedAvg's clipping and Gaussian noise (McMahan et al., ICLR 2018).

Each site clips its update Delta_k = theta_k - theta^g_{t-1} to L2 norm C, so one site changes the
sum of updates by at most C; Gaussian noise of standard deviation z * C on that sum (z, the noise
multiplier) makes each round a Gaussian mechanism, accounted in accounting.py.

Central mode: whoever holds the sum adds N(0, z^2 C^2). Distributed mode (with secure
aggregation, where nobody sees an unnoised sum): each site adds N(0, z^2 C^2 / t'), t' the
smallest number of inputs the server will ever unmask (RoundSetup.min_survivors); a sum of
m >= t' such inputs carries variance m * z^2 C^2 / t' >= z^2 C^2. Dropped sites only raise the
bar, and honest sites' noise alone suffices as long as at least t' of them are in the sum.

The guarantee covers the *sum* of clipped updates. Dividing by a public count is post-processing;
weighting sites by their sample counts n_k raises the sensitivity to max_k w_k * C, so DP studies
weight sites uniformly (or cap the weights, as McMahan et al. do).

Noise comes from a cryptographically secure source the study seed does not determine: an AES-128-CTR
keystream keyed with 32 bytes from the OS (`secrets`), turned into normals by Box-Muller. A
study-seeded generator would let anyone who knows the seed subtract the noise; a statistical
generator (Mersenne Twister, PCG64) can be predicted from its outputs. Tests inject a fixed key.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from shared.errors import PrivacyInputError
from shared.privacy.prg import SEED_BYTES, Keystream

__all__ = [
    "AdaptiveClipping",
    "LARGEST_NORMAL",
    "ClippedUpdate",
    "NoiseSource",
    "SecureGaussian",
    "add_gaussian_noise",
    "central_noise_std",
    "clip_update",
    "distributed_noise_std",
    "effective_noise_multiplier",
    "global_l2_norm",
    "model_delta",
    "update_noise_multiplier",
]


class NoiseSource(Protocol):
    """Anything that draws standard normal samples; numpy's Generator fits too."""

    def standard_normal(self, size: int) -> np.ndarray:
        """`size` independent N(0, 1) samples as float64."""
        ...


LARGEST_NORMAL = math.sqrt(2 * 53 * math.log(2))  # ~8.6: SecureGaussian's largest |sample| (uniforms on 2^-53)


class SecureGaussian:
    """N(0, 1) samples by Box-Muller from an AES-128-CTR keystream; the key comes from the OS unless given."""

    def __init__(self, key: bytes | None = None) -> None:
        self._stream = Keystream(key if key is not None else secrets.token_bytes(SEED_BYTES))

    def standard_normal(self, size: int) -> np.ndarray:
        """`size` fresh samples; |sample| <= LARGEST_NORMAL by the 2^-53 grid of the uniforms."""
        pairs = (size + 1) // 2
        radius = np.sqrt(-2.0 * np.log(self._stream.unit_floats(pairs)))
        angle = (2.0 * math.pi) * self._stream.unit_floats(pairs)
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:size]


@dataclass(frozen=True)
class ClippedUpdate:
    """An update scaled to norm <= C, with its norm before clipping and the factor applied."""

    update: dict[str, Tensor]
    norm: float
    scale: float


def model_delta(local: Mapping[str, Tensor], global_: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Delta = theta_k - theta^g for every shared name; both dicts must name the same tensors."""
    if local.keys() != global_.keys():
        raise PrivacyInputError(f"names differ: {sorted(local.keys() ^ global_.keys())}")
    return {name: local[name].detach() - global_[name].detach() for name in local}


def global_l2_norm(tensors: Mapping[str, Tensor]) -> float:
    """The L2 norm of all tensors taken together, accumulated in float64."""
    return math.sqrt(sum(float(t.detach().double().square().sum()) for t in tensors.values()))


def clip_update(update: Mapping[str, Tensor], clip_norm: float) -> ClippedUpdate:
    """Scale `update` by min(1, C / ||update||) so its global L2 norm is at most C."""
    if not clip_norm > 0:
        raise PrivacyInputError(f"clip_norm must be positive, got {clip_norm}")
    norm = global_l2_norm(update)
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return ClippedUpdate({name: t.detach() * scale for name, t in update.items()}, norm, scale)


def central_noise_std(noise_multiplier: float, clip_norm: float) -> float:
    """The noise std z * C on the sum when one party adds it all."""
    return noise_multiplier * clip_norm


def distributed_noise_std(noise_multiplier: float, clip_norm: float, min_contributors: int) -> float:
    """Each site's noise std z * C / sqrt(t'), so any sum of >= t' sites has noise std >= z * C."""
    if min_contributors < 1:
        raise PrivacyInputError(f"min_contributors must be at least 1, got {min_contributors}")
    return noise_multiplier * clip_norm / math.sqrt(min_contributors)


def add_gaussian_noise(
    update: Mapping[str, Tensor], std: float, source: NoiseSource | None = None
) -> dict[str, Tensor]:
    """A copy of `update` plus independent N(0, std^2) on every element, tensors in sorted-name order."""
    noise_source = source if source is not None else SecureGaussian()
    noised: dict[str, Tensor] = {}
    for name in sorted(update):
        tensor = update[name].detach()
        noise = torch.from_numpy(noise_source.standard_normal(tensor.numel()) * std).reshape(tensor.shape)
        noised[name] = (tensor.double() + noise).to(tensor.dtype)
    return noised


@dataclass(frozen=True)
class AdaptiveClipping:
    """Quantile-based clipping (Andrew et al., NeurIPS 2021): C tracks the `target_quantile` of update norms.

    Each site reports b_k - 1/2 with b_k = 1 if ||Delta_k|| <= C (sensitivity 1/2); the server adds
    N(0, count_noise_std^2) to their sum (or the sites add their shares of it, as for the update
    noise) and moves C geometrically: C <- C * exp(-learning_rate * (b_bar - target_quantile)).
    Andrew et al. suggest target_quantile 0.5, learning_rate 0.2 and count_noise_std = m / 20 for
    m expected sites; the count noise costs privacy, see effective_noise_multiplier.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_std: float = 1.0

    def clip_bit(self, norm: float, clip_norm: float) -> float:
        """A site's centred report: +1/2 if its update fits under C, -1/2 if it was clipped."""
        return 0.5 if norm <= clip_norm else -0.5

    def next_clip_norm(self, clip_norm: float, noised_bit_sum: float, expected_sites: float) -> float:
        """C * exp(-eta * (b_bar - gamma)), b_bar = noised_bit_sum / m + 1/2 the noised fraction unclipped."""
        unclipped_fraction = noised_bit_sum / expected_sites + 0.5
        return clip_norm * math.exp(-self.learning_rate * (unclipped_fraction - self.target_quantile))


def effective_noise_multiplier(update_noise_multiplier: float, count_noise_std: float) -> float:
    """The z = (z_Delta^-2 + (2 sigma_b)^-2)^-1/2 of a round with adaptive clipping, as one Gaussian mechanism."""
    return (update_noise_multiplier**-2 + (2 * count_noise_std) ** -2) ** -0.5


def update_noise_multiplier(target_noise_multiplier: float, count_noise_std: float) -> float:
    """The update noise z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 that keeps a round at noise multiplier z."""
    remainder = target_noise_multiplier**-2 - (2 * count_noise_std) ** -2
    if remainder <= 0:
        raise PrivacyInputError(
            f"count noise {count_noise_std} alone exceeds noise multiplier {target_noise_multiplier}"
        )
    return remainder**-0.5
