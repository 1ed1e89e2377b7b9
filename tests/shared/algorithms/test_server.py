import pytest
import torch

from shared.algorithms.aggregation import weighted_average
from shared.algorithms.server import ScaffoldAggregator, ServerAggregator, next_global
from shared.tensors.codec import dump, read_header
from shared.tensors.windows import tensor_pieces

PREVIOUS = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3), "scaffold.c.w": torch.tensor([0.5, -1.0])}
UPDATES = [
    ({"w": torch.tensor([3.0, 2.0]), "n": torch.tensor(5), "scaffold.delta_c.w": torch.tensor([1.0, 0.0])}, 0.25),
    ({"w": torch.tensor([1.0, 6.0]), "n": torch.tensor(4), "scaffold.delta_c.w": torch.tensor([3.0, 2.0])}, 0.75),
]


def test_scaffold_step_by_hand() -> None:
    # mean y = (1.5, 5.0); x + 0.5 (mean - x) = (1.25, 3.5); c + Σ delta c / N = (0.5 + 4/4, -1 + 2/4)
    result = next_global(ScaffoldAggregator(server_lr=0.5, n_sites=4), PREVIOUS, UPDATES)
    assert result.keys() == {"w", "n", "scaffold.c.w"}
    torch.testing.assert_close(result["w"], torch.tensor([1.25, 3.5]))
    torch.testing.assert_close(result["scaffold.c.w"], torch.tensor([1.5, -0.5]))
    assert int(result["n"]) == 5  # integer buffers: the maximum, as in every average


def test_scaffold_with_server_lr_one_is_exactly_the_weighted_average() -> None:
    result = next_global(ScaffoldAggregator(server_lr=1.0, n_sites=2), PREVIOUS, UPDATES)
    models = [({k: v for k, v in t.items() if not k.startswith("scaffold.")}, w) for t, w in UPDATES]
    average = weighted_average(models)
    assert torch.equal(result["w"], average["w"])


def _pieces_into(aggregator: ServerAggregator, tensors: dict, weight: float) -> None:
    blob = dump(tensors)
    header = read_header(blob)
    aggregator.add_pieces(header.specs, tensor_pieces(header, lambda o, n: blob[o : o + n], max_bytes=8), weight)


def test_stored_pieces_and_memory_give_bit_identical_results() -> None:
    generator = torch.Generator().manual_seed(3)
    previous = {"w": torch.randn(300, generator=generator), "scaffold.c.w": torch.randn(300, generator=generator)}
    updates = [
        ({"w": torch.randn(300, generator=generator), "scaffold.delta_c.w": torch.randn(300, generator=generator)}, w)
        for w in (0.2, 0.3, 0.5)
    ]
    in_memory = next_global(ScaffoldAggregator(0.7, 5), previous, updates)
    streamed = ScaffoldAggregator(0.7, 5)
    assert streamed.previous is not None
    _pieces_into(streamed.previous, previous, 1.0)
    for tensors, weight in updates:
        _pieces_into(streamed, tensors, weight)
    result = streamed.result()
    assert all(torch.equal(result[name], in_memory[name]) for name in in_memory)


def test_scaffold_needs_the_previous_model_and_delta_c() -> None:
    aggregator = ScaffoldAggregator(1.0, 2)
    aggregator.add(UPDATES[0][0], 1.0)
    with pytest.raises(ValueError, match="previous"):
        aggregator.result()
    with pytest.raises(ValueError, match="delta_c"):
        ScaffoldAggregator(1.0, 2).add({"w": torch.zeros(2)}, 1.0)
    lacking = ScaffoldAggregator(1.0, 2)
    assert lacking.previous is not None
    lacking.previous.add({"w": torch.zeros(2), "n": torch.tensor(0)}, 1.0)
    lacking.add(UPDATES[0][0], 1.0)
    with pytest.raises(ValueError, match="server control variate"):
        lacking.result()


def test_the_plain_server_update_is_the_weighted_average_and_reads_no_previous_model() -> None:
    aggregator = ServerAggregator()
    assert aggregator.previous is None
    models = [({k: v for k, v in t.items() if not k.startswith("scaffold.")}, w) for t, w in UPDATES]
    result = next_global(aggregator, PREVIOUS, models)
    assert all(torch.equal(result[k], weighted_average(models)[k]) for k in result)
