"""Every rule of a study's terms that needs more than their fields: the one place terms are checked whole.

`StudyTerms` (shared/terms) is data and checks what its fields say. What needs the algorithm registry,
the model's exchange, the privacy accounting or the secure-aggregation setup is checked here, by
`check_study`, at each boundary where terms come in: `cardiofl study create` before it sends them
(`read_study_file`), the coordinator when it creates a study (`checked_terms`), and a site when its
operator approves a study and when it checks a task against the approved terms.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from shared.algorithms.registry import ALGORITHMS, RuleSpec, exchange_of, parsed_params, rules_of
from shared.algorithms.server import ServerAggregator
from shared.privacy.errors import SetupError
from shared.study.accounting import dp_setup_problem
from shared.study.secure_setup import check_secure_study
from shared.terms import StudyTerms, TermsError, read_terms_table, terms_from, terms_of_table

__all__ = [
    "Problem",
    "averages_model_tensors",
    "check_study",
    "checked_terms",
    "read_study_file",
    "with_full_params",
]

FieldPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """Why a study's terms cannot run, at the path of the setting to change (`privacy.dp.mode`)."""

    path: FieldPath
    message: str

    def __str__(self) -> str:
        return f"{'.'.join(str(part) for part in self.path) or '(the terms)'}: {self.message}"


def check_study(terms: StudyTerms) -> list[Problem]:
    """Every problem of `terms` beyond their fields; [] when the study can run as its terms say."""
    problems = [problem for spec, part in _rule_specs(terms) for problem in _rule_problems(spec, part)]
    if problems:  # the later rules read the rules' params
        return problems
    problems = _nothing_shared_problems(terms)
    if problems:  # the later rules would refuse the same terms for reasons beside the point
        return problems
    if terms.buffered is not None:
        problems = _buffered_problems(terms)
        if problems:
            return problems
    if terms.privacy.secure_aggregation is not None:
        try:
            check_secure_study(terms)
        except SetupError as exc:
            problems.append(Problem(tuple(exc.field.split(".")), str(exc)))
    if (terms.model.site_heads or terms.privacy.dp is not None) and not averages_model_tensors(terms):
        why = "per-site head splits need" if terms.model.site_heads else "differential privacy clips and averages"
        problems.append(
            Problem(
                ("algorithm", "name"),
                f"{why} an algorithm whose server takes the plain weighted average of model tensors; "
                f"{terms.algorithm.name!r} uploads other tensors or updates theta^g its own way",
            )
        )
    elif terms.privacy.dp is not None:
        dp_problem = dp_setup_problem(terms)  # distributed without secure aggregation, the ring, the budget
        if dp_problem is not None:
            problems.append(Problem(*dp_problem))
    return problems


def checked_terms(raw: Mapping[str, Any] | StudyTerms, source: str = "the study's terms") -> StudyTerms:
    """`raw` as terms that can run, each rule's params completed with its defaults; TermsError naming every problem."""
    terms = raw if isinstance(raw, StudyTerms) else terms_from(raw, source)
    problems = check_study(terms)
    if problems:
        raise TermsError([str(problem) for problem in problems], source)
    return with_full_params(terms)


def read_study_file(path: Path, table: Mapping[str, Any] | None = None) -> tuple[str | None, StudyTerms]:
    """(its `name`, if any; the checked terms) of a study's TOML file, as `cardiofl study create` sends them.

    `table` is the file's table as the caller read it (`read_terms_table`) and changed it, if it did.
    """
    name, terms = terms_of_table(read_terms_table(path) if table is None else table, str(path))
    return name, checked_terms(terms, str(path))


def averages_model_tensors(terms: StudyTerms) -> bool:
    """Whether the algorithm uploads model tensors only and the server takes their plain weighted average."""
    params = parsed_params(terms.algorithm)
    exchange = exchange_of(terms.model.config(), terms.algorithm.name, params)
    rule = ALGORITHMS[terms.algorithm.name]
    return not exchange.uploads and type(rule.server(params, len(terms.sites))) is ServerAggregator


def _buffered_problems(terms: StudyTerms) -> list[Problem]:
    """What a buffered asynchronous study cannot have: a cohort per round, per-site head weights, Scaffold."""
    buffered = terms.buffered
    assert buffered is not None
    refused = (
        (terms.kind != "train", ("buffered",), f"a {terms.kind} study trains nothing to buffer"),
        (
            buffered.buffer_size > len(terms.sites),
            ("buffered", "buffer_size"),
            f"{buffered.buffer_size} updates cannot fill a buffer: a site has one update in a buffer, and the study "
            f"has {len(terms.sites)} sites",
        ),
        (
            terms.min_sites > buffered.buffer_size,
            ("min_sites",),
            f"the quorum {terms.min_sites} exceeds the {buffered.buffer_size} updates that release a version",
        ),
        (
            terms.privacy.secure_aggregation is not None,
            ("privacy", "secure_aggregation"),
            "secure aggregation needs a synchronous cohort (every site of a round masks against the others' keys "
            "and the unmasking waits for them all); a buffered study has none: leave it out",
        ),
        (
            terms.privacy.dp is not None and terms.privacy.dp.mode != "central",
            ("privacy", "dp", "mode"),
            "a buffered release is noised by the coordinator (central DP): distributed noise needs secure "
            "aggregation, which a buffered study cannot run",
        ),
        (
            terms.participation.name != "all",
            ("participation", "name"),
            "every site takes part in a buffered study, each at its own pace: participation must be 'all'",
        ),
        (
            bool(terms.model.site_heads) or terms.algorithm.name == "learned_heads",
            ("model", "site_heads") if terms.model.site_heads else ("algorithm", "name"),
            "heads weighed per site (site_heads, learned_heads) are averaged over each round's cohort; a buffered "
            "study has none",
        ),
    )
    problems = [Problem(path, message) for on, path, message in refused if on]
    if not problems and not averages_model_tensors(terms):
        problems.append(
            Problem(
                ("algorithm", "name"),
                f"algorithm {terms.algorithm.name!r} keeps server state that assumes synchronous rounds (or uploads "
                "other tensors): a buffered study needs one whose server takes the plain average of model tensors",
            )
        )
    return problems


def _nothing_shared_problems(terms: StudyTerms) -> list[Problem]:
    """Terms about what sites upload, refused where the algorithm uploads no tensor (the local baseline)."""
    exchange = exchange_of(terms.model.config(), terms.algorithm.name, parsed_params(terms.algorithm))
    if exchange.upload_schema():
        return []
    why = f"algorithm {terms.algorithm.name!r} uploads no tensor: every model tensor stays at its site"
    refused = (
        (terms.privacy.secure_aggregation is not None, ("privacy", "secure_aggregation"), "masks what sites upload"),
        (terms.privacy.dp is not None, ("privacy", "dp"), "clips and noises what sites upload"),
        (bool(terms.model.site_heads), ("model", "site_heads"), "choose which heads each site uploads"),
    )
    return [Problem(path, f"{path[-1]} {what}, and {why}; leave it out") for on, path, what in refused if on]


def _rule_specs(terms: StudyTerms) -> Iterator[tuple[RuleSpec, str]]:
    """The terms' named rules with their sections."""
    yield terms.algorithm, "algorithm"
    yield terms.aggregation, "aggregation"
    yield terms.participation, "participation"


def _rule_problems(spec: RuleSpec, part: str) -> list[Problem]:
    """An unknown rule name, or each param its rule's own model refuses."""
    rules = rules_of(spec)
    if spec.name not in rules:
        return [Problem((part, "name"), f"unknown {spec.kind} {spec.name!r}; choose one of {sorted(rules)}")]
    try:
        rules[spec.name].params.model_validate(spec.params)
    except ValidationError as exc:
        return [
            Problem((part, "params", *error["loc"]), error["msg"].removeprefix("Value error, "))
            for error in exc.errors(include_url=False)
        ]
    return []


def with_full_params(terms: StudyTerms) -> StudyTerms:
    """The terms with each rule's params as its params model dumps them: every default written out."""
    update: dict[str, BaseModel] = {}
    for spec, part in _rule_specs(terms):
        full = parsed_params(spec).model_dump(mode="json")
        if full != spec.params:
            update[part] = spec.model_copy(update={"params": full})
    return terms.model_copy(update=update) if update else terms
