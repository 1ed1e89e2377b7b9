"""FedALA's client (Zhang et al., AAAI 2023), as PFLlib `ALA.py` / FedCVD `fedala.py` run it.

Before training, the site's own model m_k takes theta^g_{t-1} for every parameter but the
`layer_idx` trailing ones ("higher": 1 is `head.bias`), which become m + (g - m) * W with W
learned on a random contiguous `rand_percent`% slice of the training split (no shuffling). In the
first round the site has no own model yet (m = g) and ALA is off; in the first active round W
starts at ones and is learned until the std of the last `num_pre_loss` epoch losses is below
`threshold` (at most `max_start_epochs`); later, one epoch. W learns with the model in eval mode
(`weight_learning_mode`, FedCVD: its ALA copies a model just evaluated) or train mode (PFLlib).
Then the model trains as in FedAvg and is uploaded whole. The site keeps W and its trained higher
tensors. BatchNorm statistics (`bn_statistics`): "averaged" as in FedCVD, they are uploaded and
averaged with the rest, while the site's model keeps its own through ALA (which copies parameters
only), so the site keeps a copy of them too; "local" as in PFLlib, they stay at the site. Epoch
losses are per-sample means, as in FedCVD.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from shared.algorithms.exchange import FEDALA_BN, FEDALA_LOCAL, FEDALA_WEIGHT, fedala_higher, model_names
from shared.algorithms.params import FedALAParams
from shared.tensors.codec import TensorDict
from site_agent.algorithms.adaptive import initial_weight, learn_mix_weights
from site_agent.algorithms.base import ClientAlgorithm, RoundContext, RoundOutcome, detached
from site_agent.data import SplitArrays

__all__ = ["FedALA", "adaptive_local_aggregation"]


def adaptive_local_aggregation(ctx: RoundContext) -> tuple[TensorDict, TensorDict]:
    """(the round's start state after ALA, the learned W); W is empty while ALA is still off."""
    params = ctx.params
    assert isinstance(params, FedALAParams)
    higher = fedala_higher(ctx.config, ctx.exchange.partition, params.layer_idx)
    start = {**ctx.start_state(), **(ctx.kept(FEDALA_BN, _statistics_kept(ctx)) or {})}
    own = ctx.kept(FEDALA_LOCAL, higher)
    if own is None or not higher:  # first round: the site's model is the global one, ALA is off
        return start, {}
    kept_weights = ctx.kept(FEDALA_WEIGHT, higher)
    start_phase = kept_weights is None
    device = ctx.runtime.device
    weights = {name: initial_weight(kept_weights, own, name).to(device) for name in higher}
    own_d = {name: own[name].to(device) for name in higher}
    received_d = {name: ctx.received[name].to(device) for name in higher}

    def done(losses: list[float]) -> bool:
        if not start_phase or len(losses) >= params.max_start_epochs:
            return True
        recent = losses[-params.num_pre_loss :]
        return len(losses) > params.num_pre_loss and statistics.pstdev(recent) < params.threshold

    temporary = ctx.build(start)  # its BatchNorm statistics move while W learns; it is then dropped
    learn_mix_weights(
        temporary,
        higher,
        own_d,
        received_d,
        weights,
        ctx.epoch("fedala.weights", split=_random_slice(ctx, params.rand_percent), shuffle=False),
        eta=params.eta,
        done=done,
        runtime=ctx.runtime,
        stop=ctx.stop,
        train_mode=params.weight_learning_mode == "train",
    )
    learned = dict(temporary.named_parameters())
    return {**start, **detached({name: learned[name] for name in higher})}, detached(weights)


def _statistics_kept(ctx: RoundContext) -> tuple[str, ...]:
    """The BatchNorm statistics the site keeps a copy of: all when they are averaged, none when local."""
    assert isinstance(ctx.params, FedALAParams)
    return model_names(ctx.config).buffers if ctx.params.bn_statistics == "averaged" else ()


def _random_slice(ctx: RoundContext, rand_percent: int) -> SplitArrays:
    """rand_percent% of the training split, contiguous from a random start (PFLlib's `rand_idx`)."""
    train = ctx.data.train
    count = max(1, int(rand_percent / 100 * len(train)))
    start = int(torch.randint(0, len(train) - count + 1, (1,), generator=ctx.generator("fedala.slice")))
    stop = start + count
    return SplitArrays(train.signals[start:stop], train.labels[start:stop], train.record_ids[start:stop])


class FedALA(ClientAlgorithm):
    """ALA, then a FedAvg round; keeps W and the trained higher tensors."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One round: adaptive local aggregation, then local training."""
        assert isinstance(ctx.params, FedALAParams)
        start, weights = adaptive_local_aggregation(ctx)
        model = ctx.build(start)
        result = ctx.train(model, ctx.round_steps())
        higher = fedala_higher(ctx.config, ctx.exchange.partition, ctx.params.layer_idx)
        trained = dict(model.named_parameters())
        state = {**detached({name: trained[name] for name in higher}, FEDALA_LOCAL), **detached(weights, FEDALA_WEIGHT)}
        after = model.state_dict()
        state.update(detached({name: after[name] for name in _statistics_kept(ctx)}, FEDALA_BN))
        return RoundOutcome(model, result, state=state)

    def personal_model(self, ctx: RoundContext) -> nn.Module:
        """The site's model as a round would start from theta^g_T: after ALA (W is not kept)."""
        return ctx.build(adaptive_local_aggregation(ctx)[0])
