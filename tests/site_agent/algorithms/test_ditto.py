from shared.algorithms.exchange import DITTO_PERSONAL
from shared.model.network import build_model
from shared.model.partition import model_schema
from shared.study.rules import initial_state
from shared.wire.protocol import EvalSummary
from site_agent.data.loader import SiteData
from site_agent.local_round import evaluate
from tests.site_agent.algorithms.conftest import RUNTIME, assert_same, differs, final_evaluation, local_round, study

CONFIG = study("ditto", {"mu": 0.01})


def _personal(local: dict) -> dict:
    return {name.removeprefix(DITTO_PERSONAL): t for name, t in local.items() if name.startswith(DITTO_PERSONAL)}


FEDCVD_FIGURES = {"n_samples", "loss", "micro_f1", "map", "map_present"}  # which model it was; intervals aside


def _evaluated(state: dict, site: SiteData) -> dict:
    model = build_model(CONFIG.model.config(), seed=CONFIG.seed)
    model.load_state_dict(state)
    return evaluate(model, site.test, RUNTIME).summary(CONFIG.privacy, seed=0).model_dump(include=FEDCVD_FIGURES)


def _reported(summary: EvalSummary | None) -> dict:
    assert summary is not None
    return summary.model_dump(include=FEDCVD_FIGURES)


def test_the_uploaded_model_trains_as_fedavg_and_the_personal_model_differs(site: SiteData) -> None:
    ditto = local_round(CONFIG, site)
    fedavg = local_round(study("fedavg"), site)
    assert_same(ditto.shared, fedavg.shared)  # the global model's round is FedAvg's
    personal = _personal(ditto.local)
    assert personal.keys() == model_schema(CONFIG.model.config()).keys()  # the whole model, kept at the site
    assert differs(personal, ditto.shared)


def test_the_personal_model_is_what_the_site_evaluates(site: SiteData) -> None:
    first = local_round(CONFIG, site)
    personal = _personal(first.local)
    assert _reported(first.meta.metrics.local_eval) == _evaluated(personal, site)
    trained_global = {**first.shared, **{n: t for n, t in first.local.items() if not n.startswith(DITTO_PERSONAL)}}
    assert _reported(first.meta.metrics.local_eval) != _evaluated(trained_global, site)
    # the next round continues from the kept personal model, and the final evaluation uses it too
    theta, _ = initial_state(CONFIG)
    second = local_round(CONFIG, site, local_tensors=first.local, round_=2)
    assert differs(_personal(second.local), personal)
    final = final_evaluation(CONFIG, site, global_tensors=theta, local_tensors=second.local)
    assert _reported(final.meta.metrics.local_eval) == _evaluated(_personal(second.local), site)
    assert final.local == second.local
