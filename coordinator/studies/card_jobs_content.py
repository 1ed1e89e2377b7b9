"""The model card's sections from site jobs: Data (a survey of the training sites) and External validation."""

from __future__ import annotations

from coordinator.studies.card_blocks import DASH, METRICS, Block, Bullets, Paragraph, Section, Table, figure
from shared.evaluation.survey import HIDDEN, LOWER_BOUND
from shared.wire.card import CardData, CardDataRow, CardExternal, ModelCard

__all__ = ["data_sections", "external_sections"]

_CHOSEN = {
    "named": "named for this card",
    "latest": "the newest survey study that surveyed every training site",
    "self": "this study's own survey",
}


def _every(external: CardExternal) -> str:
    every = external.every
    return "every released model" if every == 1 else f"the models of rounds {every}, {2 * every}, {3 * every}, …"


def _external_reading(card: ModelCard, external: CardExternal) -> str:
    t = external.round
    if t is None:
        return "No validation site has reported an evaluation yet."
    if external.final:
        return f"The final global model θ^g_{t} (after the last round, {t}) at each validation site."
    return (
        f"θ^g_{t}, the newest global model a validation site evaluated: not the final model of the study "
        f"({card.status}, {card.terms.rounds} rounds)."
    )


def external_sections(card: ModelCard) -> list[Section]:
    """External validation: the validation sites' figures of the final theta^g; none without validation sites."""
    external = card.external
    if external is None:
        return []
    rows = []
    for site in external.sites:
        summary = site.eval
        if summary is None:
            rows.append((site.site, "not reported", *(DASH for _ in METRICS)))
            continue
        records = DASH if summary.n_samples is None else str(summary.n_samples)
        rows.append((site.site, records, *(figure(summary, key) for key, _ in METRICS)))
    evaluated = ", ".join(str(t) for t in external.rounds) or DASH
    return [
        Section(
            "External validation",
            [
                Paragraph(
                    f"Sites that never trained: {', '.join(external.validation_sites)}. Each evaluates the released "
                    "global model θ^g_t with φ_0 (what a new hospital starts from) on all its records, "
                    f"{_every(external)} and the final one; their figures are in none of the tables above, and "
                    "no training weight, quorum or pooled figure counts them."
                ),
                Paragraph(f"{_external_reading(card, external)} Rounds evaluated so far: {evaluated}."),
                Paragraph("Each figure is exact at the site, with its 95% bootstrap interval."),
                Table(("validation site", "records", *(name for _, name in METRICS)), rows),
            ],
        )
    ]


def _prevalence(row: CardDataRow) -> str:
    if row.prevalence is None:
        return DASH
    return (LOWER_BOUND if row.pooled.hidden else "") + f"{row.prevalence:.1%}"


def _site_rows(data: CardData, rows: list[CardDataRow]) -> list[tuple[str, ...]]:
    return [(row.key, *(row.sites[site].text for site in data.sites), row.pooled.text) for row in rows]


def _data_intro(data: CardData) -> list[Paragraph]:
    noise = (
        f" Each count carries discrete Gaussian noise of sigma {data.noise_sigma:g}"
        + (f": epsilon = {data.epsilon:.3f} at delta = {data.delta:g}." if data.epsilon is not None else ".")
        if data.noise_sigma is not None
        else ""
    )
    awaiting = f" Not reported: {', '.join(data.awaiting)}." if data.awaiting else ""
    return [
        Paragraph(
            f"From survey study {data.study_id} ({data.name}, {data.status}), {_CHOSEN[data.chosen]}: each training "
            f"site's data-readiness survey, counts of records only. Surveyed: {', '.join(data.sites) or DASH}."
            f"{awaiting}"
        ),
        Paragraph(
            f"{HIDDEN}: suppressed (a count below {data.min_records}, or hidden so that none can be worked out); "
            f"{LOWER_BOUND}n: the sum of the counts shown, some being suppressed.{noise}"
        ),
    ]


def data_sections(card: ModelCard) -> list[Section]:
    """Data: the training sites' records as their survey pooled them; none without a survey of them."""
    data = card.data
    if data is None:
        return []
    blocks: list[Block] = [*_data_intro(data)]
    if not data.sites:
        blocks.append(Paragraph("No training site has reported its survey yet."))
        return [Section("Data", blocks)]
    labels = [(row.key, row.pooled.text, _prevalence(row)) for row in data.labels]
    suppressed = [f"{site}: {data.suppressed[site]} of its {data.counts} counts" for site in data.sites]
    blocks += [
        Table(("records", *data.sites, "pooled"), _site_rows(data, data.records)),
        Paragraph(
            "The most frequent labels among the kept (train and test) records, with their prevalence where every "
            "site's records were shown:"
        ),
        Table(("label", "records", "prevalence"), labels or [(DASH, DASH, DASH)]),
        Paragraph("Signal-quality flags, over all records read (train, test and excluded):"),
        Table(("quality flag", *data.sites, "pooled"), _site_rows(data, data.quality)),
        Paragraph("Counts each site suppressed:"),
        Bullets(suppressed),
    ]
    return [Section("Data", blocks)]
