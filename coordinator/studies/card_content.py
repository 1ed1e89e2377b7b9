"""What a model card says, as plain-text blocks (sections, paragraphs, tables) that card_render writes out."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from coordinator.studies.card_blocks import (
    DASH,
    METRICS,
    Bullets,
    Code,
    Diagram,
    Paragraph,
    Section,
    Table,
    figure,
    number,
)
from coordinator.studies.card_jobs_content import data_sections, external_sections
from shared.terms import StudyTerms
from shared.wire.card import CardPlugin, CardSite, ModelCard
from shared.wire.metrics import MetricSummary

__all__ = ["card_sections"]


def _when(moment: datetime | None) -> str:
    return DASH if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _params(params: dict[str, object]) -> str:
    return f" ({', '.join(f'{k} = {v}' for k, v in sorted(params.items()))})" if params else ""


def _terms_items(terms: StudyTerms) -> list[str]:
    """The terms in words: what runs, for how long, and what protects the sites."""
    own = ", ".join(f"{site} {split}" for site, split in sorted(terms.model.site_heads.items()))
    t = terms.training
    privacy = terms.privacy
    dp = privacy.dp
    items = [
        f"sites: {', '.join(terms.sites)}",
        f"model: {terms.model.preset}, heads {terms.model.heads}" + (f" (per site: {own})" if own else ""),
        f"training: {t.optimizer}, lr {t.lr:g}, batch {t.batch_size}, {t.local_epochs} local epoch(s)"
        + (f", at most {t.max_steps} steps" if t.max_steps else ""),
        f"algorithm: {terms.algorithm.name}{_params(terms.algorithm.params)}",
        f"aggregation: {terms.aggregation.name}{_params(terms.aggregation.params)}; participation: "
        f"{terms.participation.name}{_params(terms.participation.params)}",
        f"rounds T = {terms.rounds}, quorum {terms.min_sites} site(s), deadline {terms.round_deadline_s:g} s, "
        f"{terms.round_retries} retries, seed {terms.seed}",
        f"privacy: pooled statistics only from at least {privacy.min_records} test records; "
        + ("secure aggregation (SecAgg+)" if privacy.secure_aggregation is not None else "no secure aggregation")
        + "; "
        + (
            f"differential privacy ({dp.mode}, z = {dp.noise_multiplier:g}, C = {dp.clip_norm:g}, delta = {dp.delta:g})"
            if dp is not None
            else "no differential privacy"
        ),
    ]
    return items


def _provider(plugin: CardPlugin, release: str) -> str:
    if plugin.identity is None:
        return f"cardiofl {release} (built-in)"
    i = plugin.identity
    return f"{i.distribution} {i.version} (files sha256 {i.sha256})"


def _header(card: ModelCard) -> Section:
    return Section(
        f"Model card: {card.name}",
        [
            Paragraph(
                f"Study {card.study_id} ({card.uid}), {card.status}: {card.completed_rounds} of {card.terms.rounds} "
                f"rounds completed. Created by {card.created_by} on {_when(card.created_at)}; this card was made on "
                f"{_when(card.generated_at)} by cardiofl {card.release} (protocol {card.protocol}) from the API's "
                "figures."
            )
        ],
    )


def _terms(card: ModelCard) -> list[Section]:
    rows = [(p.role, p.name, _provider(p, card.release)) for p in card.plugins]
    approvals = [
        (
            a.site,
            a.state,
            a.digest or DASH,
            _when(a.reported_at),
            "yes" if a.current else f"no (the current terms describe as {a.expected_digest})",
        )
        for a in card.approvals
    ]
    dumped = json.dumps(card.terms.model_dump(mode="json"), indent=2, sort_keys=True)
    return [
        Section(
            "Terms",
            [
                Paragraph(f"sha256 of the terms' canonical JSON: {card.terms_digest}"),
                Bullets(_terms_items(card.terms)),
                Code(dumped),
            ],
        ),
        Section("Plug-ins", [Table(("rule", "name", "provided by"), rows)]),
        Section(
            "Approvals",
            [
                Paragraph("Each site's operator approves the digest of the terms as described for that site."),
                Table(("site", "state", "approved digest", "reported", "of the current terms"), approvals),
            ],
        ),
    ]


def _figure_rows(sites: Sequence[CardSite], card: ModelCard) -> list[tuple[str, ...]]:
    def row(who: str, model: str, summary: MetricSummary | None) -> tuple[str, ...]:
        records = DASH if summary is None or summary.n_samples is None else str(summary.n_samples)
        return (who, model, records, *(figure(summary, key) for key, _ in METRICS))

    label = card.global_label or "global model"
    rows = []
    for site in sites:
        if not site.reported:
            rows.append((site.site, "no update in this round", DASH, *(DASH for _ in METRICS)))
            continue
        rows += [row(site.site, "own model", site.local_eval), row(site.site, label, site.eval)]
    pooled = card.pooled_eval
    pooled_sites = f"{pooled.n_sites} site(s)" if pooled is not None and pooled.n_sites is not None else "the sites"
    rows += [
        row("pooled", f"{label} over {pooled_sites}", pooled),
        row("pooled", "own models, mean weighted by test records", card.pooled_local_eval),
    ]
    return rows


def _reading(card: ModelCard) -> str:
    t = card.evaluated_round
    label = f'the global model ("{card.global_label}")' if card.global_label else "the global model"
    if t is None:
        return "No round has completed yet: there are no figures."
    if card.final:
        return (
            f"The final evaluation: {label} after the last round ({t}) on every site's test split, evaluated in round "
            f"{t + 1}, and each site's own model after round {t}."
        )
    return f"Round {t} (not the final evaluation): {label} after round {t}, and each site's own model after it."


def _figures(card: ModelCard) -> Section:
    return Section(
        "Figures",
        [
            Paragraph(_reading(card)),
            Paragraph(
                "A site's own model is evaluated exactly at the site, with 95% bootstrap intervals; the global model's "
                "figures come from the site's counts and score histograms. Pooled, the global model's figures are "
                "those of all the sites' records from the summed histograms, ± the most they can differ from the "
                "exact value, with 95% intervals; the own models' pooled figures are means without intervals."
            ),
            Table(("site", "model", "test records", *(name for _, name in METRICS)), _figure_rows(card.sites, card)),
        ],
    )


def _reliability(card: ModelCard) -> Section:
    if not card.reliability:
        return Section("Reliability diagram", [Paragraph("No pooled histograms of the global model to draw it from.")])
    rows = [
        (
            f"{b.low:.1f}–{b.high:.1f}",
            str(b.count),
            number(b.observed),
            DASH if b.predicted is None else f"{number(b.predicted)} ± {number(b.predicted_error)}",
        )
        for b in card.reliability
    ]
    pooled = card.pooled_eval
    return Section(
        "Reliability diagram",
        [
            Paragraph(
                f"The global model's predicted probabilities against the observed fraction of positives, pooled over "
                f"the sites' histograms (all records and classes): ECE {figure(pooled, 'ece')}."
            ),
            Diagram(card.reliability),
            Table(("predicted probability", "count", "observed", "mean predicted"), rows),
        ],
    )


def _baseline(card: ModelCard) -> list[Section]:
    if card.baseline is None:
        return []
    b = card.baseline
    rows = [
        (site.site, name, figure(site.baseline, key), figure(site.local_eval, key), figure(site.eval, key))
        for site in card.sites
        for key, name in METRICS
    ]
    at = f"its figures after round {b.round}" if b.round is not None else "no round of it has completed yet"
    return [
        Section(
            "Local baseline",
            [
                Paragraph(
                    f"Study {b.study_id} ({b.name}, {b.status}): each site trained alone (algorithm local); {at}."
                ),
                Table(("site", "figure", "alone", "federated: own model", "federated: global model"), rows),
            ],
        )
    ]


def _g(value: float | None) -> str:
    return DASH if value is None else f"{value:g}"


def _privacy(card: ModelCard) -> Section:
    p = card.privacy
    if p is None or p.epsilon is None:
        return Section("Differential privacy", [Paragraph("None: no epsilon bounds what the released models reveal.")])
    budget = f" of a budget of {_g(p.epsilon_budget)}" if p.epsilon_budget else ""
    relation = f", under {p.relation} neighbours (sensitivity {_g(p.sensitivity)})" if p.relation else ""
    noise = " ".join(part for part in (p.mode, p.mechanism, "noise") if part)
    return Section(
        "Differential privacy",
        [
            Paragraph(
                f"epsilon = {number(p.epsilon)}{budget} at delta = {_g(p.delta)} after {p.rounds} released model(s)"
                f"{relation}; {noise}, z = {_g(p.noise_multiplier)}, C = {_g(p.clip_norm)}, accountant {p.accountant}."
            )
        ],
    )


def _models(card: ModelCard) -> Section:
    rows = [(str(m.round), m.sha256, f"{m.size:,}", m.local_sha256 or DASH) for m in card.models]
    return Section("Global models", [Table(("round t", "θ^g_t sha256", "bytes", "φ_0 sha256"), rows)])


def card_sections(card: ModelCard) -> list[Section]:
    """The card's sections in order: the study, terms, approvals, data, figures, external validation, baseline, ..."""
    limits = [limitation.text for limitation in card.limitations]
    return [
        _header(card),
        *_terms(card),
        *data_sections(card),
        _figures(card),
        _reliability(card),
        *external_sections(card),
        *_baseline(card),
        _privacy(card),
        _models(card),
        Section("Known limitations", [Bullets(limits) if limits else Paragraph("None known.")]),
    ]
