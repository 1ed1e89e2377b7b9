import pytest

from shared.algorithms.exchange import model_names
from site_agent.algorithms.base import RoundContext
from site_agent.algorithms.fedrep import train_head_then_body
from site_agent.data.loader import SiteData
from tests.site_agent.algorithms.conftest import context, differs, local_round, study

CONFIG = study("fedrep", {"plocal_epochs": 2}, training={"lr": 0.05, "batch_size": 8, "max_steps": 2})
NAMES = model_names(CONFIG.model.config())


def test_head_trains_first_then_the_body(site: SiteData, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = context(CONFIG, site)
    model = ctx.build(ctx.start_state())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    phases: list[tuple[tuple[str, ...], int, dict]] = []
    original = RoundContext.train

    def recording(self, model, steps, *, trainable=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
        result = original(self, model, steps, trainable=trainable, **kwargs)
        phases.append((tuple(trainable), steps, {n: p.detach().clone() for n, p in model.named_parameters()}))
        return result

    monkeypatch.setattr(RoundContext, "train", recording)
    result = train_head_then_body(ctx, model, head_epochs=2)
    (head, head_steps, after_head), (body, body_steps, after_body) = phases
    assert head == NAMES.head and set(body) == set(NAMES.parameters) - set(NAMES.head)
    assert head_steps == ctx.epoch_steps(2) == 4 and body_steps == ctx.round_steps() == 2
    assert result.steps == 6
    assert differs({n: after_head[n] for n in NAMES.head}, before)
    assert not differs({n: after_head[n] for n in body}, before)  # the body waits while the head trains
    assert not differs({n: after_body[n] for n in NAMES.head}, after_head)  # then the head is frozen
    assert differs({n: after_body[n] for n in body}, after_head)


def test_the_head_stays_at_the_site(site: SiteData) -> None:
    result = local_round(CONFIG, site)
    assert set(NAMES.head) <= set(result.local) and not set(NAMES.head) & set(result.shared)
    per = local_round(study("fedper"), site)
    assert set(NAMES.head) <= set(per.local) and not set(NAMES.head) & set(per.shared)
