"""`cardiofl model export`: a study's global evaluation model (theta^g_T with phi_0) as a torch.export file.

The researcher's side, over the REST API: the study's config and its stored models are read with a
researcher token, theta^g_t and phi_0 are downloaded, checked against their digests and the study's
schema (safetensors only), and the model is built as the sites' global evaluation builds it
(docs/researcher/model.md: theta^g with the initial local tensors phi_0), then written by shared/model/export.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cardiofl.client.cli import DEFAULT_URL, TokenOption, UrlOption, connected
from cardiofl.client.http import ApiError, CardioflClient

if TYPE_CHECKING:
    from torch import nn

    from shared.terms.model_config import ModelConfig

__all__ = ["export_global_model", "global_evaluation_model"]


def _checked(body: bytes, sha256: str, what: str) -> bytes:
    actual = hashlib.sha256(body).hexdigest()
    if actual != sha256:
        raise ApiError(f"{what}: sha256 {actual} differs from the coordinator's {sha256}")
    return body


def global_evaluation_model(
    client: CardioflClient, study_id: int, round_: int | None = None
) -> tuple[nn.Module, ModelConfig, dict[str, Any]]:
    """(theta^g_t with phi_0 as a model in eval mode, its config, its description); t: the newest round unless given."""
    from shared.algorithms.learned_heads import LEARNED_SPLIT
    from shared.model.network import build_model, load_released
    from shared.study.rules import algorithm_model, study_exchange
    from shared.tensors.codec import PayloadError, load, validate

    study = client.study(study_id)
    config = study.config
    exchange = study_exchange(config)
    if not exchange.partition.shared:  # theta^g holds nothing: the model would be phi_0, untrained
        raise ApiError(
            f"study {study_id} shares no model tensor (algorithm {config.algorithm.name!r}), so it has no global "
            "model: each site exports its own model (`cardiofl site export`)"
        )
    models = {entry.round: entry for entry in client.global_models(study_id)}
    if not models:
        raise ApiError(f"study {study_id} has no global model yet (start it first)")
    chosen = max(models) if round_ is None else round_
    if chosen not in models:
        raise ApiError(f"study {study_id} has no global model of round {chosen} (rounds {min(models)}-{max(models)})")
    initial = client.download_initial_local(study_id)
    body = client.download_global_model(study_id, chosen)
    try:
        shared, _ = validate(_checked(body, models[chosen].sha256, f"round {chosen}"), exchange.global_schema())
        local, _ = load(_checked(initial, str(models[0].local_sha256), "phi_0"))
    except PayloadError as exc:
        raise ApiError(f"the models of study {study_id} do not fit its config: {exc}") from None
    if set(local) != set(exchange.partition.local):
        raise ApiError(f"phi_0 of study {study_id} does not hold the study's local tensors")
    model_config = algorithm_model(config.model, config.algorithm)
    model = build_model(model_config, config.seed)
    state = {**{name: shared[name] for name in exchange.partition.shared}, **local, **exchange.fixed_tensors(local)}
    load_released(model, state)
    description = {
        "model": "global",
        "study": study_id,
        "study_uid": study.uid,
        "study_status": study.status,
        "round": chosen,
        "global_sha256": models[chosen].sha256,
        "local_sha256": models[0].local_sha256,
        "preset": config.model.preset,
        "heads": LEARNED_SPLIT if model_config.learned_heads else config.model.heads,
        "algorithm": config.algorithm.name,
    }
    return model.eval(), model_config, description


def export_global_model(
    study: Annotated[int, typer.Option("--study", help="Study id.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The .pt2 file to write.")],
    round_: Annotated[
        int | None, typer.Option("--round", help="Export theta^g of this round (default: the newest, theta^g_T).")
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Download a study's global model (theta^g_T with phi_0) and write it as a torch.export file (.pt2)."""
    from shared.model.export import export_model, export_summary
    from site_agent.data.records import STANDARD_LEADS

    with connected(url, token) as client:
        model, config, description = global_evaluation_model(client, study, round_)
    if description["study_status"] != "completed":
        status, newest = description["study_status"], description["round"]
        typer.echo(f"note: study {study} is {status}; round {newest} is the one exported", err=True)
    metadata = export_model(model, config, out, leads=STANDARD_LEADS, description=description)
    summary = export_summary(metadata)
    typer.echo(f"wrote {out}: the global model of study {study} round {description['round']}; {summary}")
