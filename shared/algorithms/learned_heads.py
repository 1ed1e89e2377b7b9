"""Learned head assignment (issues #19, #33): per-head gates that mix a global and a local version of every head.

The model (`ModelConfig.learned_heads`, shared/model/network.py) holds every head h of block b twice: in the
global branch (theta^g) and in the local branch (phi_k). A gate g_{b,h} = sigmoid(z_{b,h}), its logit
`blocks.<b>.head_gate` in phi_k, weighs head h's attended values before each branch's W_out: by
1 - g in the global branch, by g in the local one. Per head before W_out because heads are
independent there (W_out is a sum over heads), so the gate scales exactly one head's contribution
and its gradient; at hard gates (0 or 1) the model is a per-site split of arbitrary head sets.

- Training (site_agent/algorithms/learned_heads.py): by default the gates take no gradient; each round
  every gate logit steps toward local where a held-out carve of the site's training split shows the
  head, or its whole block, does better local than global, else toward global (issue #33). Issue
  #19's alternative trains them with the model on the site's loss plus `gate_penalty` x the mean
  binary entropy of its gates. Both are deterministic, so a round stays reproducible.
- Freezing: once a site has trained `freeze_after` rounds, its gates are set to hard 0/1 (logits
  +-FROZEN_LOGIT, whose sigmoid is exactly 1 or 0 in float32) and no longer trained.
- Upload: the (blocks, H) usages u_{b,h} = 1 - g_{b,h} travel in UpdateMeta.head_usage, like n_k;
  the gates and the local heads never leave the site.
- Aggregation: HeadSplitAverage with those usages: each global head's slices of W_in / W_out are
  averaged with weights w_k * u_{k,b,h}, renormalised per head; W_out's bias of the global branch
  (shared by the block's heads) with w_k * mean_h u_{k,b,h}, so a site pulls on it as much as it uses
  the branch (a site using no global head does not move it); every other tensor with w_k.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from shared.model.network import ModelConfig

__all__ = [
    "FROZEN_LOGIT",
    "LEARNED_HEADS",
    "LEARNED_SPLIT",
    "gate_entropy",
    "gate_names",
    "hardened",
    "head_usage",
    "usage_tensor",
]

LEARNED_HEADS = "learned_heads"  # the algorithm's name in shared/algorithms/registry.py
LEARNED_SPLIT = "learned"  # the head split a learned-heads model reports (each site has its own)
FROZEN_LOGIT = 1.0e4  # sigmoid(+-1e4) is exactly 1 or 0 in float32 and float64, its gradient exactly 0


def gate_names(config: ModelConfig) -> tuple[str, ...]:
    """The gate logits' state names, one (H,) tensor per block."""
    return tuple(f"blocks.{b}.head_gate" for b in range(config.n_blocks))


def gate_entropy(logits: Tensor) -> Tensor:
    """Binary entropy of sigmoid(logits) per element, in nats: softplus(z) - z * sigmoid(z), finite everywhere."""
    return torch.nn.functional.softplus(logits) - logits * torch.sigmoid(logits)


def hardened(logits: Tensor, undecided: Literal["local", "global"] = "local") -> Tensor:
    """Logits of the hard gates nearest sigmoid(logits): +FROZEN_LOGIT where g > 1/2, -FROZEN_LOGIT where g < 1/2.

    A gate at exactly g = 1/2 goes to `undecided`.
    """
    local = logits >= 0 if undecided == "local" else logits > 0
    return torch.where(local, FROZEN_LOGIT, -FROZEN_LOGIT).to(logits.dtype)


def head_usage(state: Mapping[str, Tensor], config: ModelConfig) -> list[list[float]]:
    """u_{b,h} = 1 - sigmoid(z_{b,h}) of a site's gate logits in `state`: what its upload carries."""
    return [(1 - torch.sigmoid(state[name].detach().float())).tolist() for name in gate_names(config)]


def usage_tensor(usage: Sequence[Sequence[float]]) -> Tensor:
    """An uploaded usage as the (blocks, H) float64 tensor HeadSplitAverage takes."""
    return torch.tensor(usage, dtype=torch.float64)
