"""Exact surveys for the survey tests: random ones that add up, and ones with a few counts set."""

from __future__ import annotations

import numpy as np

from shared.wire.survey import GROUPS, Cell, SiteSurvey, all_cells, tables_of


def random_cells(seed: int, *, largest: int = 200) -> dict[Cell, int]:
    """The cells of a random exact survey: each group's partitions sum to its records, binaries at most them.

    Groups range from empty to `largest` records; partitions crowd a few keys and leave the rest 0 or
    small, as real sites do, so that every rule of suppression is exercised.
    """
    rng = np.random.default_rng(seed)
    cells = dict.fromkeys(all_cells(), 0)
    for group in GROUPS:
        records = int(rng.choice([0, int(rng.integers(1, 30)), int(rng.integers(1, largest + 1))]))
        cells[(group, "records", "records")] = records
        for table in tables_of(group):
            if table.partition:
                weights = rng.dirichlet(np.full(len(table.keys), 0.3))
                counts = rng.multinomial(records, weights)
            else:
                counts = rng.binomial(records, rng.choice([0.0, 0.02, 0.3, 0.97, 1.0], size=len(table.keys)))
            for key, count in zip(table.keys, counts, strict=True):
                cells[(group, table.name, key)] = int(count)
    return cells


def random_survey(seed: int, *, largest: int = 200) -> SiteSurvey:
    """A random exact survey (see random_cells)."""
    return SiteSurvey.from_cells(random_cells(seed, largest=largest))


def survey_with(records: dict[str, int], **counts: int) -> SiteSurvey:
    """An exact survey: each group's records under its first rate, duration, lead set, age and sex key and reason.

    `counts` sets further cells, written group__table__key (e.g. train__labels__AFIB=5); a partition's
    first key then takes what the set cells leave of the records.
    """
    cells = dict.fromkeys(all_cells(), 0)
    for group, n in records.items():
        cells[(group, "records", "records")] = n
        for table in tables_of(group):
            if table.partition:
                cells[(group, table.name, table.keys[0])] = n
    for name, value in counts.items():
        group, table_name, key = name.split("__")
        cell = (group, table_name, key)
        table = next(t for t in tables_of(group) if t.name == table_name)
        if table.partition:
            cells[(group, table_name, table.keys[0])] -= value - cells[cell]
        cells[cell] = value
    return SiteSurvey.from_cells(cells)
