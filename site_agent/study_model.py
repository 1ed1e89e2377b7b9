"""The model a study left at this site: theta^g_T from the coordinator with phi_k from the encrypted store.

A site token may download its studies' global models (GET /studies/{id}/models/{t}) but may not
read the study itself. So the study's uid comes from the store (its folder `<id>-<uid>`,
site_agent/approvals.py `study_key`), the newest round from the coordinator's models (probed with
`If-None-Match: *`, which answers 304 or 404 without a body), and the study's terms from what this
site's operator approved (kept in the store with the approval), checked against the tensors. The
study's TOML (as given to `cardiofl study create`) can be given instead. Without either (an
approval revoked since), the model and algorithm are read from the tensors themselves: (preset,
heads) from their names and shapes, the algorithm from what the global model holds and what the
site kept; algorithms whose personal model is learned from the site's data when it is built
(FedALA, FedAH) or whose split is learned then need the terms. The personal model is built
exactly as the final evaluation round builds it, from the terms (site_agent/local_round.py).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import numpy as np
from torch import nn

from shared.algorithms.learned_heads import LEARNED_HEADS
from shared.algorithms.registry import ALGORITHMS
from shared.labels import N_CLASSES
from shared.model.network import PRESETS, head_splits
from shared.model.partition import HEAD_GATE_PATTERN, model_schema
from shared.study.checks import read_study_file, with_full_params
from shared.study.rules import algorithm_exchange
from shared.tensors.codec import PayloadError, TensorDict, TensorSpec, read_header, schema_of, validate
from shared.terms import AlgorithmSpec, ModelSpec, StudyTerms, TermsError
from shared.wire.protocol import ErrorBody
from shared.wire.urls import global_model_url
from site_agent.algorithms import CLIENT_ALGORITHMS, ClientAlgorithm
from site_agent.algorithms.ditto import Ditto
from site_agent.approvals import recorded_terms
from site_agent.approvals import study_key as store_key
from site_agent.client import CoordinatorClient
from site_agent.data import LoadReport, SiteData, SplitArrays
from site_agent.device import Runtime
from site_agent.errors import AgentError, CoordinatorUnavailable, Unauthorized
from site_agent.local_round import LocalRoundSpec, round_context, seeded_rng
from site_agent.store import SiteStore

__all__ = [
    "SiteModel",
    "StudyModelError",
    "StudyRef",
    "StudySpec",
    "find_study",
    "infer_study",
    "load_site_model",
    "newest_round",
    "read_study_config",
]

# Personal models that are a function of the tensors alone; the others learn on the site's data.
_FROM_TENSORS = (ClientAlgorithm.personal_model, Ditto.personal_model)


class StudyModelError(AgentError):
    """The study's model cannot be assembled at this site; the message says why, in one line."""


@dataclass(frozen=True)
class StudyRef:
    """A study as this site's store knows it."""

    id: int
    uid: str

    @property
    def key(self) -> str:
        """The store's name of the study."""
        return store_key(self.id, self.uid)

    def model_url(self, round_: int) -> str:
        """theta^g_t of the study at the coordinator."""
        return global_model_url(self.id, round_)


@dataclass(frozen=True)
class StudySpec:
    """The study's terms, and where this site found them."""

    terms: StudyTerms
    origin: str  # APPROVED, CONFIG or TENSORS

    @property
    def model(self) -> ModelSpec:
        """The study's model."""
        return self.terms.model

    @property
    def algorithm(self) -> AlgorithmSpec:
        """The study's client algorithm."""
        return self.terms.algorithm

    @property
    def inferred(self) -> bool:
        """Whether the model and algorithm were read from the tensors (no terms were at hand)."""
        return self.origin == TENSORS

    def describe(self) -> str:
        """e.g. 'tiny 6:2, fedavg (the terms this site approved)'."""
        return f"{self.model.preset} {self.model.heads}, {self.algorithm.name} ({self.origin})"


APPROVED = "the terms this site approved"
CONFIG = "from the study config"
TENSORS = "read from the tensors"


@dataclass(frozen=True)
class SiteModel:
    """The site's personal model of a study's round, in eval mode on the runtime's device."""

    model: nn.Module
    study: StudyRef
    round: int  # t of theta^g_t
    global_sha256: str
    local_round: int  # the round whose phi_k was used
    spec: StudySpec

    def describe(self) -> str:
        """One line for people."""
        return (
            f"study {self.study.id}: global model of round {self.round} with phi_k of round {self.local_round}; "
            f"{self.spec.describe()}"
        )


def find_study(store: SiteStore, study: str) -> StudyRef:
    """The study `study` ('N' or 'N-<uid>') among the store's folders."""
    number, _, uid = study.partition("-")
    if not number.isdigit():
        raise StudyModelError(f"--study must be a study id such as 3 (or 3-<uid>), got {study!r}")
    folders = sorted(p.name for p in (store.root / "studies").glob(f"{int(number)}-*") if p.is_dir())
    if uid:
        folders = [name for name in folders if name == f"{int(number)}-{uid}"]
    if not folders:
        raise StudyModelError(
            f"the store at {store.root} holds nothing of study {study}: this site has not taken part in it"
        )
    if len(folders) > 1:
        raise StudyModelError(f"the store holds several studies {number} (of different coordinators): {folders}")
    found_id, _, found_uid = folders[0].partition("-")
    return StudyRef(int(found_id), found_uid)


def _probe(http: httpx.Client, url: str) -> str | None:
    """The digest of the blob at `url` (an ETag), or None when there is none; nothing is downloaded."""
    try:
        response = http.get(url, headers={"If-None-Match": "*"})
    except httpx.TransportError as exc:
        raise CoordinatorUnavailable(f"asking for {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code == 304:
        return response.headers["etag"].removeprefix("W/").strip('"')
    if response.status_code == 404:
        return None
    try:
        info = ErrorBody.model_validate_json(response.content).error
        detail = f"{response.status_code} {info.code}: {info.message}"
    except ValueError:
        detail = f"{response.status_code} {response.text[:200]}"
    if response.status_code >= 500:
        raise CoordinatorUnavailable(f"asking for {url}: {detail}")
    if response.status_code in (401, 403):
        raise Unauthorized(f"asking for {url}: {detail}")
    raise StudyModelError(f"asking for {url}: {detail}")


def newest_round(http: httpx.Client, study: StudyRef, start: int) -> tuple[int, str]:
    """(t, sha256) of the study's newest global model, searched from round `start` (models are 0..T)."""
    digest = _probe(http, study.model_url(start))
    if digest is None:  # the store is ahead (the final evaluation round T+1 keeps phi_k as round T+1)
        for round_ in range(start - 1, -1, -1):
            digest = _probe(http, study.model_url(round_))
            if digest is not None:
                return round_, digest
        raise StudyModelError(f"the coordinator has no global model of study {study.id}")
    found, step = start, 1
    while (ahead := _probe(http, study.model_url(found + step))) is not None:  # gallop, then bisect
        found, digest, step = found + step, ahead, step * 2
    low, high = found, found + step  # low exists, high does not
    while high - low > 1:
        middle = (low + high) // 2
        probed = _probe(http, study.model_url(middle))
        if probed is not None:
            low, digest = middle, probed
        else:
            high = middle
    return low, digest


def read_study_config(path: Path) -> StudyTerms:
    """A study's TOML file, as `cardiofl study create` reads it (`name` aside)."""
    try:
        return read_study_file(path)[1]
    except TermsError as exc:
        raise StudyModelError(str(exc)) from None


@functools.cache
def _known_models() -> tuple[tuple[ModelSpec, dict[str, TensorSpec]], ...]:
    """Every preset at every head split, with the names, shapes and dtypes of its state; models with attention first.

    A FedDualAtt state holds every tensor of the ResNet1D-34 of its backbone's size, so it must match its own
    preset before that one.
    """
    ordered = sorted(PRESETS.items(), key=lambda item: (not item[1].has_attention, item[0]))
    return tuple(
        (ModelSpec(preset=name, heads=heads), model_schema(config.with_heads(heads)))
        for name, config in ordered
        for heads in head_splits(config)
    )


def _model_spec(available: Mapping[str, TensorSpec]) -> ModelSpec:
    """The (preset, heads) whose every model tensor is among `available` with its shape and dtype."""
    for spec, schema in _known_models():
        if all(available.get(tensor) == tensor_spec for tensor, tensor_spec in schema.items()):
            return spec
    raise StudyModelError("the tensors match no model preset: pass the study's TOML with --study-config")


def _matches(spec: StudySpec, global_schema: Mapping[str, TensorSpec], kept: set[str]) -> bool:
    """Whether a study of `spec` has global models of `global_schema` and lets a site keep `kept`."""
    exchange = algorithm_exchange(spec.model, spec.algorithm)
    return exchange.global_schema() == global_schema and set(exchange.partition.local) <= kept <= exchange.local_names()


def _tightness(spec: StudySpec) -> tuple[int, str]:
    """How many tensors a site of `spec` may keep, and the algorithm's name: the order candidates are tried in."""
    return len(algorithm_exchange(spec.model, spec.algorithm).local_names()), spec.algorithm.name


def _from_tensors(spec: StudySpec) -> bool:
    return type(CLIENT_ALGORITHMS[spec.algorithm.name]).personal_model in _FROM_TENSORS


def infer_study(global_schema: Mapping[str, TensorSpec], kept: Mapping[str, TensorSpec]) -> StudySpec:
    """The study's model and algorithm, read from a global model's schema and the tensors the site kept.

    Algorithms that exchange and keep the same tensors (FedAvg and FedProx, FedPer and FedRep) give
    the same personal model, so any of them serves. An algorithm whose personal model is learned
    on the site's data needs its parameters and the study's seed: StudyModelError asks for the TOML.
    """
    if any(HEAD_GATE_PATTERN.match(name) for name in kept):  # gates: learned heads, whose model holds every head
        return _learned_heads_study(global_schema, kept)
    model = _model_spec({**kept, **global_schema})
    specs = (StudySpec(_inferred_terms(model, name), TENSORS) for name in ALGORITHMS)
    candidates = [spec for spec in specs if _matches(spec, global_schema, set(kept))]
    candidates.sort(key=_tightness)  # the algorithm that keeps no more than the site kept first, then by name
    if not candidates:
        raise StudyModelError(
            f"the tensors are of the {model.preset} {model.heads} model but match no algorithm's exchange "
            "with its default parameters: pass the study's TOML with --study-config"
        )
    told = [c for c in candidates if _from_tensors(c)]
    if told:  # a learned algorithm's site would keep its own state, which these cannot explain
        return told[0]
    learned = sorted({c.algorithm.name for c in candidates})
    raise StudyModelError(
        f"the study ran {' or '.join(learned)}, whose personal model depends on its parameters, the study's "
        "seed and this site's training data: pass the study's TOML with --study-config"
    )


def _learned_heads_study(global_schema: Mapping[str, TensorSpec], kept: Mapping[str, TensorSpec]) -> StudySpec:
    """A learned-heads study read from its tensors: the preset whose gated model they are.

    Its personal model is theta^g with the site's phi_k, gates included, whatever the parameters
    (they only steer training), and every split of H heads gives the same gated model, so the
    preset's own split stands for the study's.
    """
    for name, config in sorted(PRESETS.items()):
        if not config.has_attention:
            continue
        spec = StudySpec(_inferred_terms(ModelSpec(preset=name), LEARNED_HEADS), TENSORS)
        if _matches(spec, global_schema, set(kept)):
            return spec
    raise StudyModelError(
        f"the tensors hold {LEARNED_HEADS}' gates but match no preset's gated model: pass the study's TOML with "
        "--study-config"
    )


def _inferred_terms(model: ModelSpec, algorithm: str) -> StudyTerms:
    """Terms of a study of `model` under `algorithm` with its default parameters, as far as tensors tell."""
    return with_full_params(StudyTerms(sites=["site"], model=model, algorithm=AlgorithmSpec(name=algorithm)))


def _no_data() -> SiteData:
    """No records: what a personal model made from the tensors alone is given."""
    empty = SplitArrays(np.zeros((0, 0, 0), np.float32), np.zeros((0, N_CLASSES), np.float32), ())
    return SiteData(empty, empty, LoadReport([]), Path())


def _personal_model(
    spec: StudySpec,
    site: str,
    round_: int,
    global_tensors: TensorDict,
    kept: TensorDict,
    data: Callable[[], SiteData],
    runtime: Runtime,
) -> nn.Module:
    """The algorithm's own model of the site, as the final evaluation after round `round_` builds it."""
    exchange = algorithm_exchange(spec.model, spec.algorithm)
    local = LocalRoundSpec.of(spec.terms, site, round_ + 1)
    site_data = data() if not _from_tensors(spec) else _no_data()
    try:
        ctx = round_context(local, exchange, global_tensors, kept, site_data, runtime)
    except ValueError as exc:
        raise StudyModelError(f"the tensors do not fit the study config: {exc}") from None
    with seeded_rng(ctx.seed, runtime):
        model = CLIENT_ALGORITHMS[spec.algorithm.name].personal_model(ctx)
    return model.eval()


def _spec_for(
    given: StudySpec | None, global_schema: Mapping[str, TensorSpec], kept: Mapping[str, TensorSpec]
) -> StudySpec:
    """The study's terms as given (checked against the tensors), or read from the tensors."""
    if given is None:
        return infer_study(global_schema, kept)
    if not _matches(given, global_schema, set(kept)):
        raise StudyModelError(
            f"the study's terms ({given.describe()}) do not match the study's tensors at the coordinator "
            "and in this site's store"
        )
    return given


def load_site_model(
    client: CoordinatorClient,
    store: SiteStore,
    site: str,
    study: str,
    runtime: Runtime,
    *,
    data: Callable[[], SiteData],
    round_: int | None = None,
    config: StudyTerms | None = None,
) -> SiteModel:
    """The site's personal model of `study`: theta^g_t (the newest unless `round_`) with its latest phi_k.

    `client` holds the site's token (checked to be `site`'s first).
    `config` is the study's terms when the operator gives them; otherwise those this site approved,
    kept in its store with the approval; failing both, the model and algorithm are read from the
    tensors (`infer_study`). `data` opens the site's data, called only for algorithms
    whose personal model is learned on it.
    """
    ref = find_study(store, study)
    stored = store.local_rounds(ref.key)
    client.check_site(site)  # as the agent does at start: the token must be this site's
    http = client.http
    if round_ is None:
        round_, digest = newest_round(http, ref, stored[-1] if stored else 0)
    else:
        found = _probe(http, ref.model_url(round_))
        if found is None:
            raise StudyModelError(f"the coordinator has no global model of round {round_} of study {ref.id}")
        digest = found
    body = client.download(ref.model_url(round_), digest)
    committed = store.load_local_before(ref.key, round_ + 1)  # what a round after `round_` starts from
    if committed is None:
        held = f"phi_k of rounds {stored} only" if stored else "no accepted round"
        raise StudyModelError(f"the store holds {held} of study {ref.id}, none of round {round_} or before")
    local_round, kept = committed
    approved = recorded_terms(store.load_approval(ref.key))
    given = StudySpec(config, CONFIG) if config is not None else StudySpec(approved, APPROVED) if approved else None
    # The download is a bytearray, which shared.tensors.codec reads as it reads bytes (its annotations say `bytes`).
    payload = cast(bytes, body)
    try:
        spec = _spec_for(given, read_header(payload).specs, schema_of(kept))
        global_tensors, _ = validate(payload, algorithm_exchange(spec.model, spec.algorithm).global_schema())
    except PayloadError as exc:
        raise StudyModelError(f"the global model of round {round_} of study {ref.id} is unusable: {exc}") from None
    model = _personal_model(spec, site, round_, global_tensors, kept, data, runtime)
    return SiteModel(model, ref, round_, hashlib.sha256(body).hexdigest(), local_round, spec)
