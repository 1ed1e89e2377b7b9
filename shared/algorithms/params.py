"""Typed parameters of every rule a study config may name: algorithms, weightings, participation policies.

Defaults are FedCVD's (papers/fedcvd-spec.md §4-§5) where FedCVD has the method, else the
original code's (PFLlib, FedAH, DataTools4Heart).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from shared.errors import StudyRuleError

__all__ = [
    "DittoParams",
    "FedAHParams",
    "FedALAParams",
    "FedBNParams",
    "FedPerParams",
    "FedProxParams",
    "FedRepParams",
    "FractionParams",
    "LearnedHeadsParams",
    "NoParams",
    "Params",
    "RandomDropoutParams",
    "ScaffoldParams",
    "SmoothedParams",
    "UncertaintyParams",
]


class Params(BaseModel):
    """Base of every rule's parameters: unknown keys are refused, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class NoParams(Params):
    """Parameters of a rule that takes none: any key is refused."""


# -- client algorithms ---------------------------------------------------------------------


class FedProxParams(Params):
    """FedProx: loss + (mu/2) * ||w - w_global||^2 over the shared parameters."""

    mu: float = Field(0.01, ge=0)  # FedCVD: 0.01; 0 is plain FedAvg


class LearnedHeadsParams(Params):
    """Learned head assignment: how the gates move and when they freeze (site_agent/algorithms/learned_heads.py)."""

    # "validation": each round, every gate steps toward local where a held-out carve of the site's training
    # split shows the head does better local, else toward global; "gradient": the gates train with the model
    gate_update: Literal["validation", "gradient"] = "validation"
    gate_step: float = Field(1.0, gt=0)  # validation: change of a gate logit per round
    # validation: each head compared hard global against hard local ("extremes"), or its logit one
    # gate_step lower against one higher ("step": which way lowers the loss where the mix stands now)
    gate_test: Literal["extremes", "step"] = "step"
    local_margin: float = Field(0.01, ge=0)  # validation: relative fall of the loss that makes a head go local
    # validation: relative fall of the loss with a whole block local that carries its heads that lower it at all
    block_margin: float = Field(0.02, ge=0)
    gate_bound: float = Field(1.0, gt=0)  # validation: |gate logit| stays within this until the gates freeze
    validation_fraction: float = Field(0.2, gt=0, lt=1)  # validation: share of the training split held out
    gate_penalty: float = Field(0.01, ge=0)  # gradient: loss + lambda * mean_{b,h} H(g_{b,h}), in nats
    freeze_after: int | None = Field(None, ge=1)  # a site's trained rounds before its gates are hard 0/1; None: never
    # validation: a site whose gates all sat unchanged at +-gate_bound after this many comparisons in a
    # row hardens them then, before freeze_after, and trains on its whole split; None: never
    settle_after: int | None = Field(5, ge=1)
    # validation: the held-out carve still trains the shared tensors each round, through the global heads
    # alone (every gate hard global on its batches), so holding records out costs the shared model nothing;
    # its records never reach a local head
    carve_trains_shared: StrictBool = False
    # validation: the comparisons read a copy of the model whose local heads alone first trained this many
    # epochs on the rest of the split, every gate hard local (the local heads a site would have); 0: as kept
    probe_epochs: int = Field(20, ge=0)
    # validation: with 2 or more, no carve is held out: the comparisons are cross-fitted over this many folds
    # of the whole split, each read by fresh local heads (phi_0's) that trained probe_epochs epochs on the
    # other folds' records, every gate hard local, over the backbone's tokens of theta^g_{t-1}
    probe_folds: int = Field(4, ge=0)
    # validation: the gates step by this round's comparison ("round"), or by the mean of the falls of every
    # comparison so far but the first `evidence_skip` (whose heads had trained a round or so), kept at the site
    evidence: Literal["round", "mean"] = "mean"
    evidence_skip: int = Field(1, ge=0)
    # a gate logit at exactly 0 (g = 1/2, undecided) when the gates harden: "local" or "global"
    undecided: Literal["local", "global"] = "global"

    @field_validator("probe_folds")
    @classmethod
    def _folds_or_none(cls, folds: int) -> int:
        """0 (a held-out carve) or at least 2 folds: one fold would leave nothing to train the probe on."""
        if folds == 1:
            raise StudyRuleError("probe_folds is 0 (a held-out carve) or at least 2")
        return folds


class ScaffoldParams(Params):
    """Scaffold: the server's learning rate in x <- x + server_lr * (mean(y_k) - x)."""

    server_lr: float = Field(1.0, gt=0, le=10)  # FedCVD: 1.0


class DittoParams(Params):
    """Ditto: the personal model's loss + (mu/2) * ||v - w_received||^2."""

    mu: float = Field(0.01, ge=0)  # FedCVD: 0.01


class FedALAParams(Params):
    """FedALA's adaptive local aggregation (PFLlib `ALA`, FedCVD `fedala.py`)."""

    eta: float = Field(1.0, ge=0)  # learning rate of the element-wise aggregation weights
    rand_percent: int = Field(80, ge=1, le=100)  # % of the local training data the weights learn on
    layer_idx: int = Field(1, ge=1)  # trailing model.parameters() tensors aggregated adaptively (1: head.bias)
    threshold: float = Field(0.1, ge=0)  # first active round: stop when std of the last losses is below
    num_pre_loss: int = Field(10, ge=1)  # ... over this many epoch losses
    max_start_epochs: int = Field(100, ge=1)  # safety cap on that first loop (PFLlib has none)
    # Mode of the model W learns through. "eval" (FedCVD): its ALA copies a model just evaluated, so
    # BatchNorm uses running statistics and dropout is off; "train" (PFLlib `ALA.py`): batch statistics.
    weight_learning_mode: Literal["eval", "train"] = "eval"
    # BatchNorm running statistics: "averaged" with the whole state (FedCVD), or "local" (PFLlib: parameters only)
    bn_statistics: Literal["averaged", "local"] = "averaged"


class FedAHParams(Params):
    """FedAH: aggregated-head weight learning, then FedRep's head-then-body training."""

    eta: float = Field(1.0, ge=0)  # learning rate of the head's aggregation weights (FedAH code: 1.0)
    plocal_epochs: int = Field(1, ge=1, le=1_000)  # epochs of head-weight learning and of head training
    # True: W learns with the training lr instead of `eta`, as the FedAH paper's experiments set it
    # (§IV: "the same as the local learning rate"); False: `eta`, as `clientah.py` hard-codes it.
    eta_is_local_lr: StrictBool = False


class FedBNParams(Params):
    """FedBN: which BatchNorm layers stay at the site."""

    # "bn_named" (FedCVD `fedbn.py`): the state names matching its filter ["BatchNorm", "bn"], i.e. bn1
    # and bn2 of the stem and every block; the downsample's BatchNorm (`downsample.1`) stays shared.
    # "all": every BatchNorm layer, as FedBN (Li et al., ICLR 2021) defines it.
    local_batchnorm: Literal["bn_named", "all"] = "bn_named"


class FedPerParams(Params):
    """FedPer: the classifier stays at the site; whether BatchNorm statistics do too."""

    # "local" (PFLlib): only parameters are exchanged, so running statistics never leave the site;
    # "shared": they are averaged with the body.
    bn_statistics: Literal["local", "shared"] = "local"


class FedRepParams(FedPerParams):
    """FedRep: train the local head for `plocal_epochs`, then the shared body for the round's steps."""

    plocal_epochs: int = Field(1, ge=1, le=1_000)  # PFLlib -pls, default 1


# -- aggregation weightings ----------------------------------------------------------------


class SmoothedParams(Params):
    """Weight smoothing: w_k = alpha/K + (1 - alpha) * n_k/n."""

    alpha: float = Field(0.25, ge=0, le=1)  # 0.25: DataTools4Heart's "lower quartile" hybrid


class UncertaintyParams(Params):
    """Uncertainty-aware weights w_k ∝ n_k / (H_k + epsilon), H_k from MC dropout at the site."""

    epsilon: float = Field(1e-6, ge=0)  # only keeps the division finite
    mc_passes: int = Field(10, ge=1, le=1_000)  # T stochastic forward passes per record
    # Share of each site's training records set aside, never trained on, to estimate H_k on
    # (seeded by the study's seed and the site); the test split is never read for H_k.
    validation_fraction: float = Field(0.1, gt=0, lt=1)


# -- participation policies ----------------------------------------------------------------


class RandomDropoutParams(Params):
    """Random centre dropout: each site is left out of a round with probability p."""

    p: float = Field(0.5, ge=0, le=1)


class FractionParams(Params):
    """Centre dropout on odd rounds: floor(f * K) of the K sites are left out."""

    f: float = Field(0.3, ge=0, le=1)
