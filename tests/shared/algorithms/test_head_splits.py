"""Per-site head splits: the masked branch, the masked upload, the per-head average against an oracle, validation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shared.algorithms.head_splits import (
    HEAD_WEIGHTS,
    HeadSplitAverage,
    per_head_names,
    site_usage,
    unused_heads_leaked,
    zero_unused_heads,
)
from shared.algorithms.server import ServerAggregator, next_global
from shared.model.network import AttentionBranch, build_model, preset
from shared.privacy.masking import sum_rings
from shared.study.checks import checked_terms
from shared.study.rules import algorithm_exchange, secure_layout, secure_site_vector, server_aggregator, shared_schema
from shared.study.secagg import decode_sum
from shared.study.server_round import server_round_from_sums
from shared.tensors.codec import dump, read_header
from shared.tensors.windows import tensor_pieces
from shared.terms import StudyTerms, TermsError
from shared.wire.protocol import UpdateMeta, UpdateMetrics

SPLITS = {"a": "6:2", "b": "3:5", "c": "8:0", "d": "0:8"}
TINY = preset("tiny")
H, E, D = TINY.n_heads, TINY.head_dim, TINY.d_model


def per_site(**changes: object) -> StudyTerms:
    model = {"preset": "tiny", "heads": "6:2", "site_heads": {"b": "3:5", "c": "8:0", "d": "0:8"}}
    return StudyTerms.model_validate({"model": model, "sites": list(SPLITS), **changes})


def random_state(config: StudyTerms, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    schema = shared_schema(config)
    return {
        name: torch.randn(spec.shape, generator=generator) if spec.dtype.is_floating_point else torch.tensor(seed)
        for name, spec in schema.items()
    }


def oracle(
    previous: dict[str, torch.Tensor], updates: list[tuple[dict[str, torch.Tensor], float, int]]
) -> dict[str, torch.Tensor]:
    """Written independently: a loop over blocks and heads, each head over the sites whose first H_g heads hold it."""
    out = {}
    for name in previous:
        stack = torch.stack([u[name].double() for u, _, _ in updates])
        weights = torch.tensor([w for _, w, _ in updates], dtype=torch.float64)
        if not previous[name].is_floating_point():
            out[name] = torch.stack([u[name] for u, _, _ in updates]).amax(0)
            continue
        if ".global_branch." not in name or "_proj." not in name:
            shape = (-1,) + (1,) * (stack.dim() - 1)
            out[name] = ((stack * weights.view(shape)).sum(0) / weights.sum()).float()
            continue
        result = previous[name].double().clone()
        for head in range(H + 1):  # H: out_proj.bias, shared by every site with a global head
            holders = [(k, w) for k, (_, w, g) in enumerate(updates) if (g > head if head < H else g > 0)]
            if not holders:
                continue
            total = sum(w for _, w in holders)
            mean = sum(w * stack[k] for k, w in holders) / total
            if name.endswith("in_proj.weight") and head < H:
                for part in range(3):
                    rows = slice(part * H * E + head * E, part * H * E + (head + 1) * E)
                    result[rows] = mean[rows]
            elif name.endswith("in_proj.bias") and head < H:
                for part in range(3):
                    rows = slice(part * H * E + head * E, part * H * E + (head + 1) * E)
                    result[rows] = mean[rows]
            elif name.endswith("out_proj.weight") and head < H:
                result[:, head * E : (head + 1) * E] = mean[:, head * E : (head + 1) * E]
            elif name.endswith("out_proj.bias") and head == H:
                result = mean
        out[name] = result.float()
    return out


def site_updates(config: StudyTerms, sites: list[str]) -> list[tuple[dict[str, torch.Tensor], float, int]]:
    updates = []
    for index, site in enumerate(sites):
        site_config = config.model.for_site(site).config()
        tensors = zero_unused_heads(random_state(config, index + 1), site_config)
        updates.append((tensors, 0.5 + index, site_config.n_global_heads))
    return updates


def test_a_masked_branch_equals_a_branch_of_only_its_heads() -> None:
    torch.manual_seed(0)
    full = AttentionBranch(TINY, H, range(2, 5)).eval()
    compact = AttentionBranch(TINY, 3).eval()
    with torch.no_grad():
        compact.in_proj.weight.copy_(full.in_proj.weight.view(3, H, E, D)[:, 2:5].reshape(-1, D))
        compact.in_proj.bias.copy_(full.in_proj.bias.view(3, H, E)[:, 2:5].reshape(-1))
        compact.out_proj.weight.copy_(full.out_proj.weight[:, 2 * E : 5 * E])
        compact.out_proj.bias.copy_(full.out_proj.bias)
        compact.norm.load_state_dict(full.norm.state_dict())
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(full(x), compact(x), rtol=1e-5, atol=1e-6)
    full(x).sum().backward()  # the heads it does not compute with get no gradient
    grad = full.in_proj.weight.grad.view(3, H, E, D)
    assert grad[:, :2].abs().sum() == 0 and grad[:, 5:].abs().sum() == 0 and grad[:, 2:5].abs().sum() > 0


def test_every_site_uploads_one_schema_and_keeps_one_schema() -> None:
    config = per_site()
    for site in SPLITS:
        exchange = algorithm_exchange(config.model.for_site(site), config.algorithm)
        assert exchange.upload_schema() == shared_schema(config)
        assert exchange.partition == algorithm_exchange(config.model, config.algorithm).partition
    assert shared_schema(config)["blocks.0.global_branch.in_proj.weight"].shape == (3 * H * E, D)


def test_the_heads_a_site_keeps_local_leave_as_zeros() -> None:
    config = per_site()
    site = config.model.for_site("b").config()  # 3:5: heads 3..7 are local
    state = random_state(config, 0)
    upload = zero_unused_heads(state, site)
    w_in = upload["blocks.1.global_branch.in_proj.weight"].view(3, H, E, D)
    assert w_in[:, 3:].abs().sum() == 0 and torch.equal(
        w_in[:, :3], state["blocks.1.global_branch.in_proj.weight"].view(3, H, E, D)[:, :3]
    )
    assert upload["blocks.0.global_branch.out_proj.weight"][:, 3 * E :].abs().sum() == 0
    assert torch.equal(upload["blocks.0.global_branch.out_proj.bias"], state["blocks.0.global_branch.out_proj.bias"])
    assert unused_heads_leaked(upload, site) == [] and unused_heads_leaked(state, site)
    none = config.model.for_site("d").config()  # 0:8: nothing of the global attention leaves, W_out's bias neither
    assert all(zero_unused_heads(state, none)[n].abs().sum() == 0 for n in state if ".global_branch.out_proj" in n)


def test_per_head_average_matches_an_independent_oracle() -> None:
    config = per_site()
    sites = ["a", "b", "d"]  # no site among them holds heads 6, 7 as global: they keep theta^g_{t-1}
    previous = random_state(config, 99)
    updates = site_updates(config, sites)
    result = next_global(server_aggregator(config, sites), previous, [(t, w) for t, w, _ in updates])
    expected = oracle(previous, updates)
    assert result.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(result[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    w_out = result["blocks.0.global_branch.out_proj.weight"]
    assert torch.equal(w_out[:, 6 * E :], previous["blocks.0.global_branch.out_proj.weight"][:, 6 * E :])


def test_streamed_pieces_equal_whole_updates_bit_for_bit() -> None:
    config = per_site()
    sites = sorted(SPLITS)
    previous, updates = random_state(config, 7), site_updates(config, sites)
    whole = next_global(server_aggregator(config, sites), previous, [(t, w) for t, w, _ in updates])
    streamed = server_aggregator(config, sites)
    assert streamed.previous is not None
    streamed.previous.add(previous, 1.0)
    for tensors, weight, _ in updates:
        blob = dump(tensors)
        header = read_header(blob)
        pieces = tensor_pieces(header, lambda o, n, b=blob: b[o : o + n], max_bytes=40)
        streamed.add_pieces(header.specs, pieces, weight)
    result = streamed.result()
    assert all(torch.equal(result[name], whole[name]) for name in whole)


def test_every_other_tensor_is_summed_as_the_plain_average_to_the_bit() -> None:
    config = per_site()
    sites = sorted(SPLITS)
    previous, updates = random_state(config, 5), site_updates(config, sites)
    ours = next_global(server_aggregator(config, sites), previous, [(t, w) for t, w, _ in updates])
    plain = next_global(ServerAggregator(), previous, [(t, w) for t, w, _ in updates])
    assert all(torch.equal(ours[n], plain[n]) for n in plain if ".global_branch." not in n or "_proj." not in n)


def test_a_uniform_split_keeps_the_compact_model_and_the_plain_average() -> None:
    uniform = StudyTerms.model_validate({"model": {"preset": "tiny", "heads": "6:2"}, "sites": ["a", "b"]})
    assert type(server_aggregator(uniform, ["a", "b"])) is ServerAggregator
    assert not uniform.model.config().full_width_heads and uniform.model.for_site("a") == uniform.model
    assert shared_schema(uniform)["blocks.0.global_branch.in_proj.weight"].shape == (3 * 6 * E, D)
    # today's model, bit for bit: the uniform study builds the very state it always did
    before = build_model(replace(TINY, n_heads=8, n_global_heads=6), 3).state_dict()
    after = build_model(uniform.model.config(), 3).state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_site_usage_is_the_first_global_heads() -> None:
    usage = site_usage(per_site().model.for_site("b").config())
    assert usage.shape == (2, H) and usage[:, :3].eq(1).all() and usage[:, 3:].eq(0).all()
    average = HeadSplitAverage(per_site().model.config(), [usage])
    average.add(random_state(per_site(), 0), 1.0)
    with pytest.raises(ValueError, match="usages of 1 sites"):
        average.add(random_state(per_site(), 1), 1.0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": {"preset": "tiny", "heads": "6:2", "site_heads": {"b": "6:3"}}}, "splits 9 heads"),
        ({"model": {"preset": "tiny", "heads": "6:2", "site_heads": {"zz": "7:1"}}}, "not in the study"),
        ({"model": {"preset": "tiny", "heads": "6:2", "site_heads": dict.fromkeys(SPLITS, "7:1")}}, "every site"),
        ({"model": {"preset": "tiny", "heads": "6:2", "site_heads": {"b": "seven"}}}, "look like"),
        ({"model": {"preset": "resnet1d34", "site_heads": {"b": "7:1"}}}, "no attention heads"),
        ({"algorithm": {"name": "scaffold"}}, "plain weighted average"),
        (
            {"aggregation": {"name": "equal"}, "privacy": {"dp": {"noise_multiplier": 1.0, "clip_norm": 1.0}}},
            "differential privacy",
        ),
    ],
)
def test_per_site_splits_are_validated(changes: dict, message: str) -> None:
    model = {"preset": "tiny", "heads": "6:2", "site_heads": {"b": "3:5", "c": "8:0", "d": "0:8"}}
    with pytest.raises(TermsError, match=message):
        checked_terms({"model": model, "sites": list(SPLITS), **changes})


def secure_theta(
    config: StudyTerms,
    previous: dict[str, torch.Tensor],
    updates: list[tuple[str, dict[str, torch.Tensor], float, UpdateMeta]],
) -> dict[str, torch.Tensor]:
    """theta^g_t through the secure path: each site's ring vector, their sum (the masks cancel), decoded."""
    layout = secure_layout(config.model, config.algorithm, train=True, fraction_bits=24, ring_bits=32)
    assert HEAD_WEIGHTS in layout.schema and layout.narrow_length > 0
    assert not set(layout.narrow_names) & per_head_names(layout.schema)  # weighted per element: in Z_2^64
    ring = sum_rings(
        secure_site_vector(layout, config.model, config.algorithm, site, tensors, weight, meta, base=previous)
        for site, tensors, weight, meta in updates
    )
    decoded = decode_sum(layout, ring, len(updates), base=previous)
    return server_round_from_sums(
        config,
        lambda average: average.add(previous, 1.0),
        decoded.schema,
        decoded.sums,
        decoded.weight_sum,
        decoded.survivors,
    )


def test_secure_per_head_average_matches_the_oracle_within_the_fixed_point_bound() -> None:
    config = per_site(min_sites=3, privacy={"secure_aggregation": {}})
    sites = ["a", "b", "d"]  # heads 6, 7: no holder among them
    previous = random_state(config, 99)
    updates = site_updates(config, sites)
    meta = UpdateMeta(num_examples=10, metrics=UpdateMetrics(loss=0.0), train_seconds=0.0)
    total = sum(w for _, w, _ in updates)  # a site's w_k is normalised; the per-head average is the same
    normalised = [(s, t, w / total, meta) for s, (t, w, _) in zip(sites, updates, strict=True)]
    theta = secure_theta(config, previous, normalised)
    expected = oracle(previous, updates)
    assert theta.keys() == expected.keys()
    bound = 3 * 2.0**-25 / (0.5 / total)  # K * 2^-(f+1) over the smallest per-head weight sum
    for name in expected:
        if expected[name].is_floating_point():
            torch.testing.assert_close(theta[name], expected[name], rtol=1e-6, atol=bound + 1e-6, msg=name)
    w_out = "blocks.0.global_branch.out_proj.weight"
    assert torch.equal(theta[w_out][:, 6 * E :], previous[w_out][:, 6 * E :])  # no holder: theta^g_{t-1}, exactly


def test_secure_learned_heads_average_matches_the_plain_one_and_drops_unused_heads() -> None:
    config = StudyTerms.model_validate(
        {
            "model": {"preset": "tiny", "heads": "6:2"},
            "algorithm": {"name": "learned_heads"},
            "sites": ["a", "b", "c"],
            "min_sites": 3,
            "privacy": {"secure_aggregation": {}},
        }
    )
    plain_config = config.model_copy(update={"privacy": config.privacy.model_copy(update={"secure_aggregation": None})})
    previous = random_state(config, 11)
    generator = torch.Generator().manual_seed(4)
    updates = []
    for index, site in enumerate(config.sites):
        usage = torch.rand(2, H, generator=generator, dtype=torch.float64)
        usage[0, 3] = 0.0  # head 3 of block 0 used by no site: keeps theta^g_{t-1}
        meta = UpdateMeta(
            num_examples=10, metrics=UpdateMetrics(loss=0.0), train_seconds=0.0, head_usage=usage.tolist()
        )
        updates.append((site, random_state(config, index + 1), 0.2 + 0.3 * index, meta))
    theta = secure_theta(config, previous, updates)
    plain = next_global(
        server_aggregator(plain_config, config.sites, [m for *_, m in updates]),
        previous,
        [(t, w) for _, t, w, _ in updates],
    )
    for name in plain:
        if plain[name].is_floating_point():
            torch.testing.assert_close(theta[name], plain[name], rtol=1e-5, atol=1e-5, msg=name)
    w_out = "blocks.0.global_branch.out_proj.weight"
    assert torch.equal(theta[w_out][:, 3 * E : 4 * E], previous[w_out][:, 3 * E : 4 * E])
