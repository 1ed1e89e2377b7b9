"""The researcher's and admin's commands over the REST API: `cardiofl study|token ...`, `cardiofl site enroll ...`.

Each command calls `CardioflClient`; `--json` prints the answer's wire model (shared/wire/api.py) as
JSON, the tables show the same models for people.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer
from pydantic import BaseModel, TypeAdapter
from rich.console import Console

from cardiofl.client.http import ApiError, CardioflClient, StudyAction, tls_from_env
from cardiofl.client.resumable_download import RETRIES
from cardiofl.client.study_jobs import ExternalWatch, job_renderables, job_views
from shared.tables import Table
from shared.terms import ModelSpec, StudyTerms, TermsError
from shared.wire.api import SitePublic, StudyPublic, TokenIssued, TokenPublic
from shared.wire.metrics import PrivacySpent

__all__ = [
    "DEFAULT_URL",
    "SiteListed",
    "TokenOption",
    "UrlOption",
    "WaitOption",
    "connected",
    "site_admin_app",
    "study_app",
    "token_app",
]

study_app = typer.Typer(help="Create, run and read federated studies.", no_args_is_help=True)
token_app = typer.Typer(help="Issue, list and revoke admin, researcher and viewer tokens.", no_args_is_help=True)
site_admin_app = typer.Typer(help="Enroll, list and revoke sites at the coordinator.", no_args_is_help=True)

console = Console()

UrlOption = Annotated[
    str, typer.Option("--url", envvar="CARDIOFL_URL", help="Coordinator base URL.", show_default=True)
]
TokenOption = Annotated[
    str | None, typer.Option("--token", envvar="CARDIOFL_TOKEN", help="Your bearer token.", show_default=False)
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]
WaitOption = Annotated[float, typer.Option(min=1, help="Seconds each long-poll may wait (the server caps it).")]
TokenFileOption = Annotated[
    Path | None, typer.Option(help="Write the site token to this file (mode 600) instead of printing it.")
]
DEFAULT_URL = "http://127.0.0.1:8000"

Shown = TypeVar("Shown", bound=BaseModel | Sequence[BaseModel])


class SiteListed(SitePublic):
    """A site as `cardiofl site list` shows it: whether it holds a live token ("?" when the caller may not see)."""

    token: Literal["live", "revoked", "?"]


@contextmanager
def connected(url: str, token: str | None) -> Iterator[CardioflClient]:
    """A client of the coordinator at `url`; an ApiError inside ends the command with one line on stderr."""
    try:
        client = CardioflClient.connect(url, token, verify=tls_from_env())
    except ApiError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        yield client
    except ApiError as exc:
        if exc.status == 401 and not token:
            typer.echo("error: no token given: set CARDIOFL_TOKEN or pass --token", err=True)
        else:
            typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        client.close()


def _print_json(data: Any) -> None:
    """Models (or lists or dicts of them) as their JSON (`model_dump(mode="json")`), the coordinator's schema."""
    sys.stdout.write(json.dumps(TypeAdapter(Any).dump_python(data, mode="json"), indent=2) + "\n")


def _emit(data: Shown, as_json: bool, table: Callable[[Shown], Table]) -> None:
    if as_json:
        _print_json(data)
    else:
        console.print(table(data))


def _g(value: float | None) -> str:
    """A setting as Python's general format writes it (1e-05, 0.1), or a dash when there is none."""
    return "–" if value is None else f"{value:g}"


def _when(moment: datetime | None, default: str = "") -> str:
    """A time to the second, as the coordinator writes it (2024-05-01T12:00:00)."""
    return default if moment is None else moment.isoformat()[:19]


def _heads_text(model: ModelSpec) -> str:
    """'tiny 6:2', with each site's own split where the study gives sites their own (model.site_heads)."""
    own = ", ".join(f"{site} {split}" for site, split in sorted(model.site_heads.items()))
    return f"{model.preset} {model.heads}" + (f" (per site: {own})" if own else "")


def _studies_table(studies: Sequence[StudyPublic]) -> Table:
    table = Table("id", "name", "status", "round", "rounds", "model", "algorithm", "sites", title="Studies")
    for s in studies:
        trains = s.config.kind == "train"  # a survey or an evaluate study trains nothing: its kind for its algorithm
        table.add_row(
            str(s.id),
            s.name,
            s.status,
            str(s.current_round or "–"),
            f"{s.completed_rounds}/{s.config.rounds}" if trains else "–",
            _heads_text(s.config.model) if s.config.kind != "survey" else "–",
            s.config.algorithm.name if trains else s.config.kind,
            ", ".join(s.config.sites),
        )
    return table


def _study_table(study: StudyPublic) -> Table:
    return _studies_table([study])


# studies --------------------------------------------------------------------------------------


@study_app.command("create")
def create_study(
    config_file: Annotated[Path, typer.Argument(help="Study config (TOML); see deploy/study.example.toml.")],
    name: Annotated[str | None, typer.Option(help="Study name (default: `name` in the file).")] = None,
    start: Annotated[bool, typer.Option("--start", help="Start it right away.")] = False,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a study from a TOML config file (its terms are checked here first, each error with its path).

    An evaluate study's `[evaluation]` may name model files (`model_file`, `initial_local_file`): they are
    uploaded first, and the terms name them by their digests.
    """
    from cardiofl.client.model_files import read_study_with_models, upload_models  # the checks load torch

    try:
        read = read_study_with_models(config_file)
    except TermsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    study_name = name or read.name or config_file.stem
    with connected(url, token) as client:
        upload_models(client, read.models)
        study = client.create_study(study_name, read.terms.model_dump(mode="json"))
        if start:
            study = client.study_action(study.id, "start")
    _emit(study, as_json, _study_table)


def _study_action(action: StudyAction, doc: str) -> None:
    def command(
        study_id: Annotated[int, typer.Argument(help="Study id.")],
        url: UrlOption = DEFAULT_URL,
        token: TokenOption = None,
        as_json: JsonOption = False,
    ) -> None:
        with connected(url, token) as client:
            study = client.study_action(study_id, action)
        _emit(study, as_json, _study_table)

    command.__doc__ = doc
    study_app.command(action)(command)


_study_action("start", "Start a draft study: store round 0 and open round 1.")
_study_action("pause", "Pause a running study: no new round opens until it is resumed.")
_study_action("resume", "Resume a paused study.")
_study_action("cancel", "Cancel a study; its open round is cancelled too.")


@study_app.command("list")
def list_studies(url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List studies."""
    with connected(url, token) as client:
        studies = client.studies()
    _emit(studies, as_json, _studies_table)


def _secure_lines(config: StudyTerms) -> list[str]:
    """What a secure study's rounds tolerate, in lines (none for a plain study, which loads no numpy for them)."""
    if config.privacy.secure_aggregation is None:
        return []
    from shared.study.secure_setup import secure_summary  # numpy: the secure setup's graph

    return secure_summary(config)


def _privacy_line(privacy: PrivacySpent) -> str:
    budget = f" of a budget of {privacy.epsilon_budget:g}" if privacy.epsilon_budget else ""
    epsilon = f"{privacy.epsilon:.3f}" if privacy.epsilon is not None else "–"
    return (
        f"differential privacy ({privacy.mode}, z = {_g(privacy.noise_multiplier)}, C = "
        f"{_g(privacy.clip_norm)}): epsilon = {epsilon}{budget} at delta = {_g(privacy.delta)} "
        f"after {privacy.rounds} released model(s){_relation(privacy)}"
    )


def _relation(privacy: PrivacySpent) -> str:
    """The neighbouring relation the epsilon is under, as the coordinator says it (releases before 0.6.0 do not)."""
    if privacy.relation is None:
        return ""
    mechanism = f", {privacy.mechanism} noise" if privacy.mechanism is not None else ""
    return f", {privacy.relation} neighbours (sensitivity {_g(privacy.sensitivity)}){mechanism}"


@study_app.command("show")
def show_study(
    study_id: Annotated[int, typer.Argument(help="Study id.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show a study and, per round, per-site and pooled micro-F1 / mAP / macro-AUROC, and the clinical figures.

    A study with validation sites: their external validation too, apart; an evaluate study: each site's
    evaluation; a survey study: its pooled records per group (the tables: `cardiofl study survey`).
    """
    with connected(url, token) as client:
        study = client.study(study_id)
        rounds = client.rounds(study_id)
        jobs = job_views(client, study)
    if as_json:
        _print_json({"study": study, "rounds": rounds, **jobs})
        return
    from cardiofl.client.figures import clinical_tables, round_table

    console.print(_study_table(study))
    if study.approvals:
        console.print("sites: " + ", ".join(f"{site} {state}" for site, state in sorted(study.approvals.items())))
    for line in [*([_privacy_line(study.privacy)] if study.privacy else []), *_secure_lines(study.config)]:
        console.print(line)
    if study.config.kind == "train":  # survey and evaluate studies train nothing: they have no rounds
        console.print(round_table(rounds, "micro_f1"))
        console.print(round_table(rounds, "map"))
        for table in clinical_tables(rounds):
            console.print(table)
    for shown in job_renderables(jobs, url):
        console.print(shown)


@study_app.command("watch")
def watch_study(
    study_id: Annotated[int, typer.Argument(help="Study id.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
    wait: WaitOption = 30.0,
) -> None:
    """Print each round attempt as it settles, with its clinical figures, until the study ends.

    With --json: one RoundPublic a line, as the coordinator sent it. A study with validation sites: each
    of their results not printed yet, after the round it arrived with.
    """
    from cardiofl.client.figures import watch_lines

    with connected(url, token) as client:
        external = ExternalWatch(client, study_id) if client.study(study_id).config.validation_sites else None
        for round_ in client.watch_rounds(study_id, wait=wait):
            if as_json:
                typer.echo(round_.model_dump_json())
                continue
            # theta^g_{t-1} was read by this round's sites: its pooled figures are final once this round completed
            settled = round_.status == "completed" and round_.number > 1
            earlier = client.round(study_id, round_.number - 1) if settled else None
            typer.echo("\n".join(watch_lines(round_, earlier) + (external.new_lines() if external else [])))
        if not as_json:
            for line in external.new_lines() if external else []:  # those that came after the last round
                typer.echo(line)
            typer.echo(f"study {study_id} {client.study(study_id).status}")


@study_app.command("download")
def download_model(
    study_id: Annotated[int, typer.Argument(help="Study id.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the safetensors file.")],
    round_number: Annotated[int | None, typer.Option("--round", help="Round t (default: the latest).")] = None,
    retries: Annotated[int, typer.Option(min=0, help="Retries in a row without a new byte, then stop.")] = RETRIES,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Download the global model theta^g of a round as a safetensors file, checked against its sha256.

    The bytes go to OUT.part as they arrive: a cut download resumes there, and so does the same command run again.
    """
    from cardiofl.client.model_download import download_global_model  # rich's progress bars: this command's only

    with connected(url, token) as client:
        model, got = download_global_model(client, study_id, round_number, out, retries=retries)
    typer.echo(f"wrote theta^g of round {model.round} ({got.size:,} bytes, sha256 {got.sha256}) to {out}")


# tokens ---------------------------------------------------------------------------------------


def _tokens_table(tokens: Sequence[TokenPublic]) -> Table:
    table = Table("id", "role", "site", "label", "created", "revoked", title="Tokens")
    for t in tokens:
        table.add_row(str(t.id), t.role, t.site or "", t.label, _when(t.created_at), _when(t.revoked_at))
    return table


@token_app.command("create")
def create_token(
    role: Annotated[str, typer.Argument(help="admin, researcher or viewer.")],
    label: Annotated[str, typer.Option(help="Who or what the token is for.")] = "",
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Issue a token; it is printed once and cannot be shown again."""
    with connected(url, token) as client:
        issued = client.create_token(role, label)
    if as_json:
        _print_json(issued)
    else:
        typer.echo(f"{issued.role} token {issued.id} (shown once): {issued.token}")


@token_app.command("list")
def list_tokens(url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List tokens (never their secrets)."""
    with connected(url, token) as client:
        tokens = client.tokens()
    _emit(tokens, as_json, _tokens_table)


@token_app.command("revoke")
def revoke_token(
    token_id: Annotated[int, typer.Argument(help="Token id (see `cardiofl token list`).")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Revoke a token; it stops working at once."""
    with connected(url, token) as client:
        client.revoke_token(token_id)
    typer.echo(f"revoked token {token_id}")


# sites (admin) --------------------------------------------------------------------------------


def _sites_table(sites: Sequence[SiteListed]) -> Table:
    table = Table("id", "name", "token", "enrolled", "last seen", title="Sites")
    for s in sites:
        table.add_row(str(s.id), s.name, s.token, _when(s.created_at), _when(s.last_seen_at, "never"))
    return table


def _hand_over(issued: TokenIssued, what: str, token_file: Path | None, as_json: bool, answer: BaseModel) -> None:
    """Write a new site token to `token_file` (mode 600), or print it (or the whole `answer` as JSON) once."""
    if token_file is not None:
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.touch(mode=0o600, exist_ok=False)
        token_file.write_text(issued.token + "\n")
        typer.echo(f"{what}; its token is in {token_file}")
    elif as_json:
        _print_json(answer)
    else:
        typer.echo(f"{what}; its token (shown once): {issued.token}")


@site_admin_app.command("enroll")
def enroll_site(
    name: Annotated[str, typer.Argument(help="Site name: lowercase letters, digits, '.', '_' or '-'.")],
    token_file: TokenFileOption = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Enrol a site; its token is shown (or written) once."""
    with connected(url, token) as client:
        enrolled = client.enrol_site(name)
    _hand_over(enrolled.token, f"enrolled site {name}", token_file, as_json, enrolled)


@site_admin_app.command("list")
def list_sites(url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List enrolled sites: whether each has a live token, and when it was last seen."""
    with connected(url, token) as client:
        sites = client.sites()
        try:
            live: set[str] | None = {t.site for t in client.tokens() if t.site and t.revoked_at is None}
        except ApiError as exc:
            if exc.status != 403:
                raise
            live = None  # tokens are the admin's to list: a researcher or viewer sees the sites without
    listed = [
        SiteListed(**site.model_dump(), token="?" if live is None else "live" if site.name in live else "revoked")
        for site in sites
    ]
    _emit(listed, as_json, _sites_table)


@site_admin_app.command("token")
def rotate_site_token(
    name: Annotated[str, typer.Argument(help="Site name.")],
    token_file: TokenFileOption = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Issue a site a new token (after a revoke, or a leak); its older tokens are revoked at once."""
    with connected(url, token) as client:
        issued = client.rotate_site_token(name)
    _hand_over(issued, f"new token for site {name}, older ones revoked", token_file, as_json, issued)


@site_admin_app.command("revoke")
def revoke_site(
    name: Annotated[str, typer.Argument(help="Site name.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Revoke every token of a site; its agent is refused from now on."""
    with connected(url, token) as client:
        live = [t for t in client.tokens() if t.site == name and t.revoked_at is None]
        if not live:
            raise ApiError(f"site {name!r} has no live token")
        for t in live:
            client.revoke_token(t.id)
    typer.echo(f"revoked {len(live)} token(s) of site {name}")
