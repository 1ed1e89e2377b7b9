import torch

from shared.algorithms.exchange import SCAFFOLD_C, SCAFFOLD_C_K, SCAFFOLD_DELTA_C
from shared.study.rules import initial_state, study_exchange
from site_agent.data.loader import SiteData
from tests.site_agent.algorithms.conftest import assert_same, differs, local_round, study

CONFIG = study("scaffold")
PARAMETERS = study_exchange(CONFIG).shared_parameters(CONFIG.model.config())


def _with_c(value: float) -> dict[str, torch.Tensor]:
    theta, _ = initial_state(CONFIG)
    return {name: torch.full_like(t, value) if name.startswith(SCAFFOLD_C) else t for name, t in theta.items()}


def _model_part(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if not name.startswith("scaffold.")}


def test_first_round_without_corrections_trains_as_fedavg(site: SiteData) -> None:
    scaffold = local_round(CONFIG, site)
    fedavg = local_round(study("fedavg"), site)
    assert_same(_model_part(scaffold.shared), fedavg.shared)


def test_corrections_are_applied_to_the_gradients_and_change_the_trajectory(site: SiteData) -> None:
    _, phi = initial_state(CONFIG)
    plain = local_round(CONFIG, site)
    corrected = local_round(CONFIG, site, global_tensors=_with_c(0.05))
    assert differs(_model_part(plain.shared), _model_part(corrected.shared))
    # plain SGD: every step moves each parameter by an extra -lr * (c - c_k) = -0.05 * 0.05
    steps = corrected.meta.metrics.model_extra["train_steps"]  # type: ignore[index]
    name = "head.bias"
    torch.testing.assert_close(
        corrected.shared[name] - plain.shared[name],
        torch.full_like(plain.shared[name], -0.05 * 0.05 * steps),
        rtol=0,
        atol=2e-3,  # the corrected run's own gradients differ a little too
    )
    # c == c_k: the correction is exactly zero
    c_k = {SCAFFOLD_C_K + n: torch.full_like(plain.shared[n], 0.05) for n in PARAMETERS}
    cancelled = local_round(CONFIG, site, global_tensors=_with_c(0.05), local_tensors={**phi, **c_k})
    assert_same(_model_part(cancelled.shared), _model_part(plain.shared))


def test_delta_c_follows_option_two(site: SiteData) -> None:
    theta = _with_c(0.02)
    result = local_round(CONFIG, site, global_tensors=theta)
    steps = result.meta.metrics.model_extra["train_steps"]  # type: ignore[index]
    lr = CONFIG.training.lr
    for name in PARAMETERS:
        # c_k was 0: c_k+ = -c + (x - y) / (K lr) and delta c = c_k+ - 0
        expected = -theta[SCAFFOLD_C + name] + (theta[name] - result.shared[name]) / (steps * lr)
        torch.testing.assert_close(result.shared[SCAFFOLD_DELTA_C + name], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result.local[SCAFFOLD_C_K + name], expected, rtol=1e-5, atol=1e-6)
    assert any(bool(result.shared[SCAFFOLD_DELTA_C + name].abs().sum() > 0) for name in PARAMETERS)
