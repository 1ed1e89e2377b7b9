"""Reading a study's model and algorithm from its tensors, finding its newest round, finding it in the store."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from shared.algorithms.registry import ALGORITHMS
from shared.study.rules import algorithm_exchange
from shared.terms import AlgorithmSpec, ModelSpec
from site_agent.algorithms import CLIENT_ALGORITHMS
from site_agent.errors import CoordinatorUnavailable, Unauthorized
from site_agent.store import SiteStore, generate_key
from site_agent.study_model import StudyModelError, StudyRef, find_study, infer_study, newest_round

LEARNED_ON_DATA = {"fedala", "fedah"}  # their personal model learns mixing weights on the site's data


@pytest.mark.parametrize("heads", ["6:2", "8:0", "0:8"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_tensors_tell_the_model_and_an_algorithm_of_the_same_personal_model(name: str, heads: str) -> None:
    model = ModelSpec(preset="tiny", heads=heads)
    exchange = algorithm_exchange(model, AlgorithmSpec(name=name))
    kept = {n: spec for n, spec in exchange.schema.items() if n in exchange.partition.local} | exchange.site_state
    if name in LEARNED_ON_DATA:
        with pytest.raises(StudyModelError, match=f"{name}.*--study-config"):
            infer_study(exchange.global_schema(), kept)
        return
    for kept_now in (kept, {n: exchange.schema[n] for n in exchange.partition.local}):  # trained, and phi_0 only
        spec = infer_study(exchange.global_schema(), kept_now)
        assert spec.inferred
        assert spec.model == model or name == "learned_heads" and spec.model == ModelSpec(preset="tiny")
        inferred = algorithm_exchange(spec.model, spec.algorithm)
        assert inferred.partition == exchange.partition and inferred.server_state == exchange.server_state
        chosen, ran = type(CLIENT_ALGORITHMS[spec.algorithm.name]), type(CLIENT_ALGORITHMS[name])
        assert chosen.personal_model is ran.personal_model or kept_now != kept


def test_the_small_and_paper_presets_are_told_apart() -> None:
    for preset in ("small", "paper"):
        exchange = algorithm_exchange(ModelSpec(preset=preset, heads="5:3"), AlgorithmSpec(name="fedavg"))
        kept = {n: exchange.schema[n] for n in exchange.partition.local}
        assert infer_study(exchange.global_schema(), kept).model == ModelSpec(preset=preset, heads="5:3")


def test_tensors_of_no_known_model_ask_for_the_study_config() -> None:
    exchange = algorithm_exchange(ModelSpec(preset="tiny"), AlgorithmSpec(name="fedavg"))
    schema = exchange.global_schema()
    schema.pop("head.bias")
    with pytest.raises(StudyModelError, match="no model preset.*--study-config"):
        infer_study(schema, {n: exchange.schema[n] for n in exchange.partition.local})


def coordinator_with_rounds(last: int) -> tuple[httpx.Client, list[int]]:
    """A coordinator whose study 4 has global models 0..last; the rounds asked for are recorded."""
    asked: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["if-none-match"] == "*"
        round_ = int(request.url.path.rsplit("/", 1)[1])
        asked.append(round_)
        return httpx.Response(304, headers={"ETag": f'"digest-{round_}"'}) if round_ <= last else httpx.Response(404)

    return httpx.Client(transport=httpx.MockTransport(answer), base_url="http://coordinator"), asked


@pytest.mark.parametrize("last", [0, 1, 2, 7, 50, 1000])
def test_the_newest_round_is_found_from_wherever_the_store_stands(last: int) -> None:
    for start in sorted({0, last // 2, last, last + 1}):
        http, asked = coordinator_with_rounds(last)
        assert newest_round(http, StudyRef(4, "u"), start) == (last, f"digest-{last}")
        assert len(asked) <= 2 * (last - start).bit_length() + 3  # galloping, not one request per round


def test_a_study_without_global_models_is_named() -> None:
    http, _ = coordinator_with_rounds(-1)
    with pytest.raises(StudyModelError, match="no global model of study 4"):
        newest_round(http, StudyRef(4, "u"), 3)


REFUSALS = [(403, Unauthorized), (401, Unauthorized), (503, CoordinatorUnavailable), (400, StudyModelError)]


@pytest.mark.parametrize(("status", "error"), REFUSALS)
def test_a_refusal_is_named_with_the_coordinators_reason(status: int, error: type[Exception]) -> None:
    body = {"error": {"code": "forbidden", "message": "site bern is not enrolled in study 4"}}
    http = httpx.Client(
        transport=httpx.MockTransport(lambda request: httpx.Response(status, json=body)), base_url="http://c"
    )
    with pytest.raises(error, match=f"{status} forbidden: site bern is not enrolled"):
        newest_round(http, StudyRef(4, "u"), 0)


def test_the_study_is_found_by_id_in_the_store(tmp_path: Path) -> None:
    store = SiteStore(tmp_path / "store", generate_key(), "lyon")
    uid, other = "a" * 32, "b" * 32
    store.save_local(f"3-{uid}", 1, {})
    store.save_local(f"13-{other}", 1, {})
    assert find_study(store, "3") == StudyRef(3, uid)
    assert find_study(store, f"3-{uid}").key == f"3-{uid}"
    with pytest.raises(StudyModelError, match="holds nothing of study 4"):
        find_study(store, "4")
    with pytest.raises(StudyModelError, match="study id"):
        find_study(store, "three")
    store.save_local(f"3-{other}", 1, {})  # study 3 of another coordinator's database
    with pytest.raises(StudyModelError, match="several studies 3"):
        find_study(store, "3")
    assert find_study(store, f"3-{other}") == StudyRef(3, other)
