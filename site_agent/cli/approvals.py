"""`cardiofl site studies|approve|decline|revoke-approval`: the site's operator decides which studies run here."""

from __future__ import annotations

import getpass
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shared.privacy.signing import fingerprint
from site_agent.cli.model import config_flag, reported_errors, site_http

if TYPE_CHECKING:
    from shared.plugins import PluginIdentity
    from shared.study.description import StudyDescription
    from shared.terms import AggregationSpec, AlgorithmSpec, ParticipationSpec
    from shared.wire.protocol import StudyOffer
    from site_agent.approvals import Approvals, Decision
    from site_agent.client import CoordinatorClient

__all__ = ["approve_command", "decline_command", "describe_lines", "revoke_approval_command", "studies_command"]

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Site config file (TOML); CARDIOFL_SITE_* override it.")
]
StudyArgument = Annotated[int, typer.Argument(help="The study's id, as `cardiofl site studies` lists it.")]
ReviewedDigestOption = Annotated[
    str | None,
    typer.Option("--digest", help="Act only while the study's digest is this one (the one you reviewed)."),
]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


def _approvals(config: Path | None) -> tuple[Approvals, CoordinatorClient]:
    """The site's approvals (never automatic here: the operator decides) and a client of its coordinator."""
    from site_agent.approvals import Approvals
    from site_agent.client import CoordinatorClient
    from site_agent.config import check_settings, load_settings, open_store

    settings = load_settings(config)
    store = open_store(settings, check_settings(settings))  # approving or revoking moves its approvals' version on
    return Approvals(store), CoordinatorClient(site_http(settings), tls=settings.tls)


def describe_lines(description: StudyDescription) -> list[str]:
    """A study's description as an operator reads it."""
    terms = description.terms

    def params(rule: AlgorithmSpec | AggregationSpec | ParticipationSpec) -> str:
        return f" {json.dumps(rule.params, sort_keys=True)}" if rule.params else ""

    training = terms.training
    return [
        f"sites: {', '.join(terms.sites)}; a round needs {terms.min_sites}, retried up to {terms.round_retries} times",
        f"model: {terms.model.preset}{_plugin(terms.model.plugin)}, "
        f"heads {description.global_heads} global : {description.local_heads} local "
        f"(the local heads never leave the site); {len(terms.labels)} classes",
        f"algorithm: {terms.algorithm.name}{params(terms.algorithm)}{_plugin(terms.algorithm.plugin)}; "
        f"aggregation: {terms.aggregation.name}{params(terms.aggregation)}",
        f"training: {terms.rounds} rounds, {training.local_epochs} local epoch(s) of "
        f"{training.optimizer} lr {training.lr:g}, batch {training.batch_size}"
        + (f", at most {training.max_steps} steps" if training.max_steps else ""),
        f"participation: {terms.participation.name}{params(terms.participation)}; seed {terms.seed}",
        f"each upload: {len(description.uploads)} tensors, {description.upload_values:,} numbers "
        f"({description.upload_bytes / 1e6:.1f} MB)",
        "the coordinator keeps each upload after aggregation"
        if terms.keep_updates
        else "the coordinator releases each upload once aggregated",
        *_privacy_lines(description),
        *[f"also leaves the site: {line}" for line in description.statistics],
        f"kept at the site: {len(description.kept_local)} tensors (phi_k and the algorithm's private state)",
        f"cardiofl protocol {description.protocol}; study uid {description.study_uid}; for site {description.site}",
    ]


def _plugin(named: PluginIdentity | None) -> str:
    """Which installed plug-in a model or algorithm comes from, as the terms name it (nothing for cardiofl's own)."""
    if named is None:
        return ""
    return f" (plug-in {named.distribution} {named.version}, files sha256 {named.sha256}, installed by this site)"


def _privacy_lines(description: StudyDescription) -> list[str]:
    from shared.study.secure_setup import secure_summary  # numpy: the studies' command, not `cardiofl --help`

    privacy = description.terms.privacy
    secure = privacy.secure_aggregation
    lines = [f"pooled statistics only of at least {privacy.min_records} test records"]
    if secure is not None:

        def chosen(value: int | None) -> str:
            return "per round" if value is None else str(value)

        colluding = secure.colluding_among(len(description.terms.sites))
        lines.append(
            f"secure aggregation (SecAgg+) against a coordinator colluding with up to {colluding} site(s): "
            f"neighbours {chosen(secure.neighbour_count)}, threshold {chosen(secure.threshold)}, "
            f"{secure.fraction_bits} fraction bits, phases of {secure.phase_timeout_s:g} s; this site derives each "
            "round's setup from these terms, declines any other"
        )
        lines += secure_summary(description.terms)
        keys = ", ".join(f"{site} {fingerprint(key)}" for site, key in sorted(secure.site_keys.items()))
        lines.append(
            f"signing keys (compare these fingerprints with each site's operator, out of band): {keys or 'none yet'}"
        )
    dp = privacy.dp
    if dp is None:
        lines.append("no differential privacy: the coordinator sees each upload as trained")
        return lines
    noise = "the coordinator adds" if dp.mode == "central" else "this site adds its share of"
    budget = f", training ends before epsilon {dp.epsilon_budget:g}" if dp.epsilon_budget else ""
    lines.append(
        f"differential privacy: each upload is theta^g plus this site's update clipped to L2 norm {dp.clip_norm:g} "
        f"on the 2^-f grid; {noise} discrete Gaussian noise of z = {dp.noise_multiplier:g} times that norm "
        f"(replace-one neighbours, delta {dp.delta:g}{budget})"
    )
    return lines


def _state(decision: Decision) -> str:
    from shared.study.description import terms_differences  # torch: the studies' command, not `cardiofl --help`

    if decision.approved:
        return "approved"
    if decision.declined and decision.decline is not None:
        decline = decision.decline
        return f"declined by {decline.get('declined_by')} at {decline.get('declined_at')}: {decline.get('reason')}"
    if decision.outdated:
        previous = decision.approved_terms()
        changed = terms_differences(previous, decision.description.terms) if previous is not None else []
        return f"approval outdated: the study changed ({', '.join(changed) or 'its description'})"
    return "awaiting approval"


def _find(client: CoordinatorClient, study_id: int, *, finished: bool = False) -> StudyOffer:
    from site_agent.errors import AgentError

    for offer in client.offers(finished=finished):
        if offer.study_id == study_id:
            return offer
    raise AgentError(f"study {study_id} does not list this site{'' if finished else ', or has ended'}")


def studies_command(
    config: ConfigOption = None,
    show_all: Annotated[bool, typer.Option("--all", help="Also list studies that have ended.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per study, in a list.")] = False,
) -> None:
    """List the studies that name this site: what each would run, what would leave the site, and its digest."""
    with reported_errors():
        approvals, client = _approvals(config)
        with client.http:
            decisions = [(offer, approvals.decide(offer)) for offer in client.offers(finished=show_all)]
    if as_json:
        rows = [
            {
                "study_id": offer.study_id,
                "name": offer.name,
                "status": offer.status,
                "approval": _state(decision),
                "digest": decision.digest,
                "description": decision.description.model_dump(mode="json"),
            }
            for offer, decision in decisions
        ]
        typer.echo(json.dumps(rows, indent=2))
        return
    if not decisions:
        typer.echo("no study lists this site" + ("" if show_all else " (that has not ended; --all lists those too)"))
    for offer, decision in decisions:
        sites = len(offer.terms.sites)
        typer.echo(f"study {offer.study_id} '{offer.name}' ({offer.status}, {sites} sites): {_state(decision)}")
        for line in describe_lines(decision.description):
            typer.echo(f"  {line}")
        typer.echo(f"  digest: {decision.digest}")
        if not decision.approved:
            approve = f"cardiofl site approve {offer.study_id}{config_flag(config)} --digest {decision.digest}"
            typer.echo(f"  approve with: {approve}")
        typer.echo("")


def approve_command(
    study: StudyArgument,
    config: ConfigOption = None,
    digest: ReviewedDigestOption = None,
    yes: YesOption = False,
) -> None:
    """Approve a study: this site's agent then trains for it, and uploads exactly what its description says."""
    from site_agent.errors import CoordinatorUnavailable

    with reported_errors():
        approvals, client = _approvals(config)
        with client.http:
            offer, decision = _reviewed_offer(approvals, client, study, digest, config)
            if decision.approved:
                typer.echo(f"study {study} is already approved (digest {decision.digest})")
            else:
                typer.echo(f"study {offer.study_id} '{offer.name}':")
                for line in describe_lines(decision.description):
                    typer.echo(f"  {line}")
                typer.echo(f"  digest: {decision.digest}")
                if not (yes or digest is not None) and not typer.confirm("Approve this study?", default=False):
                    raise typer.Exit(1)
                approvals.approve(offer, by=f"operator {getpass.getuser()}", description=decision.description)
                decision = replace(decision, approved=True)
                typer.echo(f"approved study {study} (digest {decision.digest})")
            try:
                approvals.report(client, decision, told=offer.approval)
            except CoordinatorUnavailable as exc:
                typer.echo(f"the coordinator was not told ({exc}); the agent tells it at its next poll")


def revoke_approval_command(study: StudyArgument, config: ConfigOption = None) -> None:
    """Withdraw the approval of a study: the agent trains for none of its later rounds."""
    from site_agent.errors import AgentError, CoordinatorUnavailable

    with reported_errors():
        approvals, client = _approvals(config)
        keys = [key for key in approvals.store.approved_studies() if key.split("-", 1)[0] == str(study)]
        if not keys:
            raise AgentError(f"study {study} has no recorded approval at this site")
        for key in keys:
            approvals.store.remove_approval(key)
        typer.echo(f"revoked the approval of study {study}; this site's agent trains for none of its later rounds")
        with client.http:
            try:
                offer = _find(client, study, finished=True)
                approvals.report(client, approvals.decide(offer), told=offer.approval)
            except (CoordinatorUnavailable, AgentError) as exc:
                typer.echo(f"the coordinator was not told ({exc}); the agent tells it at its next poll")


def _reviewed_offer(
    approvals: Approvals, client: CoordinatorClient, study: int, digest: str | None, config: Path | None
) -> tuple[StudyOffer, Decision]:
    """The study's offer and the site's decision on it; AgentError unless `digest`, when given, is its current one."""
    from site_agent.errors import AgentError

    offer = _find(client, study)
    decision = approvals.decide(offer)
    if digest is not None and digest != decision.digest:
        raise AgentError(
            f"study {study}'s description has the digest {decision.digest}, not the {digest} you reviewed: "
            f"run `cardiofl site studies{config_flag(config)}` again and review what changed"
        )
    return offer, decision


def decline_command(
    study: StudyArgument,
    reason: Annotated[str, typer.Option(help="Why this site declines the study (kept at the site, never sent).")],
    config: ConfigOption = None,
    digest: ReviewedDigestOption = None,
    yes: YesOption = False,
) -> None:
    """Decline a study: this site's agent trains for none of its rounds, and any approval of it is revoked."""
    from site_agent.errors import CoordinatorUnavailable

    with reported_errors():
        approvals, client = _approvals(config)
        with client.http:
            offer, decision = _reviewed_offer(approvals, client, study, digest, config)
            if decision.declined:
                typer.echo(f"study {study} is already declined (digest {decision.digest})")
            else:
                typer.echo(f"study {offer.study_id} '{offer.name}': digest {decision.digest}")
                if not (yes or digest is not None) and not typer.confirm("Decline this study?", default=False):
                    raise typer.Exit(1)
                record = approvals.decline(
                    offer, by=f"operator {getpass.getuser()}", reason=reason, description=decision.description
                )
                decision = replace(decision, approved=False, recorded=None, decline=record)
                typer.echo(f"declined study {study} (digest {decision.digest}); this site trains for none of it")
            try:
                approvals.report(client, decision, told=offer.approval)
            except CoordinatorUnavailable as exc:
                typer.echo(f"the coordinator was not told ({exc}); the agent tells it at its next poll")
