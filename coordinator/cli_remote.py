"""Researcher and admin commands over the REST API: `cardiofl study|token ...`, `cardiofl site ...` (admin's)."""

from __future__ import annotations

import json
import sys
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from coordinator.api_client import ApiError, CoordinatorApi, tls_from_env
from shared.terms import TermsError, read_terms_file

__all__ = ["fmt", "round_table", "site_admin_app", "study_app", "token_app"]

study_app = typer.Typer(help="Create, run and read federated studies.", no_args_is_help=True)
token_app = typer.Typer(help="Issue, list and revoke admin, researcher and viewer tokens.", no_args_is_help=True)

console = Console()

UrlOption = Annotated[
    str, typer.Option("--url", envvar="CARDIOFL_URL", help="Coordinator base URL.", show_default=True)
]
TokenOption = Annotated[
    str | None, typer.Option("--token", envvar="CARDIOFL_TOKEN", help="Your bearer token.", show_default=False)
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]
DEFAULT_URL = "http://127.0.0.1:8000"


@contextmanager
def _api(url: str, token: str | None) -> Iterator[CoordinatorApi]:
    try:
        api = CoordinatorApi.connect(url, token, verify=tls_from_env())
    except ApiError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        yield api
    except ApiError as exc:
        if exc.status == 401 and not token:
            typer.echo("error: no token given: set CARDIOFL_TOKEN or pass --token", err=True)
        else:
            typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        api.http.close()


def _emit(data: Any, as_json: bool, table: Callable[[Any], Table] | None = None) -> None:
    if as_json or table is None:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        console.print(table(data))


def fmt(value: float | None) -> str:
    """A metric with three decimals, or a dash when there is none."""
    return "–" if value is None else f"{value:.3f}"


def _studies_table(studies: list[dict[str, Any]]) -> Table:
    table = Table("id", "name", "status", "round", "rounds", "model", "algorithm", "sites", title="Studies")
    for s in studies:
        config = s["config"]
        table.add_row(
            str(s["id"]),
            s["name"],
            s["status"],
            str(s["current_round"] or "–"),
            f"{s['completed_rounds']}/{config['rounds']}",
            _heads_text(config["model"]),
            config["algorithm"]["name"],
            ", ".join(config["sites"]),
        )
    return table


def _local(update: dict[str, Any] | None, metric: str) -> str:
    local = (update or {}).get("local_eval")
    return fmt(local.get(metric)) if local else "–"


def round_table(rounds: list[dict[str, Any]], metric: str = "micro_f1", title: str | None = None) -> Table:
    """Per round, one metric: each site's personalised model, and the global model theta^g_t pooled."""
    names = {"micro_f1": "micro-F1", "map": "mAP"}
    sites = sorted({u["site"] for r in rounds for u in r["updates"]})
    table = Table(
        "round",
        "status",
        "train loss",
        *sites,
        "global",
        title=title or f"{names.get(metric, metric)}: sites' personalised models, and the global model (pooled)",
    )
    for r in rounds:
        evaluation = r.get("kind") == "evaluate"
        by_site = {u["site"]: u for u in r["updates"]}
        cells = [_local(by_site.get(site), metric) for site in sites]
        pooled = r.get("pooled") or {}
        glob = pooled.get("eval") or {}
        label = "final eval" if evaluation else str(r["number"])
        table.add_row(
            label + (f" (try {r['attempt']})" if r["attempt"] > 1 else ""),
            r["status"],
            "–" if evaluation else fmt(pooled.get("train_loss")),
            *cells,
            fmt(glob.get(metric)) if glob else "–",
        )
    return table


@study_app.command("create")
def create_study(
    config_file: Annotated[Path, typer.Argument(help="Study config (TOML); see deploy/study.example.toml.")],
    name: Annotated[str | None, typer.Option(help="Study name (default: `name` in the file).")] = None,
    start: Annotated[bool, typer.Option("--start", help="Start it right away.")] = False,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a study from a TOML config file (its terms are checked here first, each error with its path)."""
    try:
        named, _ = read_terms_file(config_file)
    except TermsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    raw = tomllib.loads(config_file.read_text())
    study_name = name or named or config_file.stem
    raw.pop("name", None)
    with _api(url, token) as api:
        study = api.create_study(study_name, raw)
        if start:
            study = api.study_action(study["id"], "start")
    _emit(study, as_json, lambda s: _studies_table([s]))


def _study_action(action: str, doc: str) -> None:
    def command(
        study_id: Annotated[int, typer.Argument(help="Study id.")],
        url: UrlOption = DEFAULT_URL,
        token: TokenOption = None,
        as_json: JsonOption = False,
    ) -> None:
        with _api(url, token) as api:
            study = api.study_action(study_id, action)
        _emit(study, as_json, lambda s: _studies_table([s]))

    command.__doc__ = doc
    study_app.command(action)(command)


_study_action("start", "Start a draft study: store round 0 and open round 1.")
_study_action("pause", "Pause a running study: no new round opens until it is resumed.")
_study_action("resume", "Resume a paused study.")
_study_action("cancel", "Cancel a study; its open round is cancelled too.")


@study_app.command("list")
def list_studies(url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List studies."""
    with _api(url, token) as api:
        studies = api.studies()
    _emit(studies, as_json, _studies_table)


@study_app.command("show")
def show_study(
    study_id: Annotated[int, typer.Argument(help="Study id.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show a study and, per round, per-site and pooled micro-F1 / mAP."""
    with _api(url, token) as api:
        study = api.study(study_id)
        rounds = api.rounds(study_id)
    if as_json:
        _emit({"study": study, "rounds": rounds}, True)
        return
    console.print(_studies_table([study]))
    approvals = study.get("approvals") or {}
    if approvals:
        console.print("sites: " + ", ".join(f"{site} {state}" for site, state in sorted(approvals.items())))
    privacy = study.get("privacy")
    if privacy:
        budget = f" of a budget of {privacy['epsilon_budget']:g}" if privacy.get("epsilon_budget") else ""
        console.print(
            f"differential privacy ({privacy['mode']}, z = {privacy['noise_multiplier']:g}, C = "
            f"{privacy['clip_norm']:g}): epsilon = {privacy['epsilon']:.3f}{budget} at delta = {privacy['delta']:g} "
            f"after {privacy['rounds']} released model(s)"
        )
    console.print(round_table(rounds, "micro_f1"))
    console.print(round_table(rounds, "map"))


@study_app.command("download")
def download_model(
    study_id: Annotated[int, typer.Argument(help="Study id.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the safetensors file.")],
    round_number: Annotated[int | None, typer.Option("--round", help="Round t (default: the latest).")] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Download the global model theta^g of a round as a safetensors file."""
    with _api(url, token) as api:
        if round_number is None:
            models = api.global_models(study_id)
            if not models:
                raise ApiError(f"study {study_id} has no global model yet")
            round_number = max(m["round"] for m in models)
        data = api.download_global_model(study_id, round_number)
    out.write_bytes(data)
    typer.echo(f"wrote theta^g of round {round_number} ({len(data):,} bytes) to {out}")


# tokens ---------------------------------------------------------------------------------------


def _tokens_table(tokens: list[dict[str, Any]]) -> Table:
    table = Table("id", "role", "site", "label", "created", "revoked", title="Tokens")
    for t in tokens:
        table.add_row(
            str(t["id"]),
            t["role"],
            t.get("site") or "",
            t.get("label") or "",
            str(t["created_at"])[:19],
            str(t["revoked_at"])[:19] if t.get("revoked_at") else "",
        )
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
    with _api(url, token) as api:
        issued = api.create_token(role, label)
    if as_json:
        _emit(issued, True)
    else:
        typer.echo(f"{issued['role']} token {issued['id']} (shown once): {issued['token']}")


@token_app.command("list")
def list_tokens(url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List tokens (never their secrets)."""
    with _api(url, token) as api:
        tokens = api.tokens()
    _emit(tokens, as_json, _tokens_table)


@token_app.command("revoke")
def revoke_token(
    token_id: Annotated[int, typer.Argument(help="Token id (see `cardiofl token list`).")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Revoke a token; it stops working at once."""
    with _api(url, token) as api:
        api.revoke_token(token_id)
    typer.echo(f"revoked token {token_id}")


# sites (admin) --------------------------------------------------------------------------------


def _sites_table(sites: list[dict[str, Any]]) -> Table:
    table = Table("id", "name", "token", "enrolled", "last seen", title="Sites")
    for s in sites:
        table.add_row(
            str(s["id"]),
            s["name"],
            s.get("token", "?"),
            str(s["created_at"])[:19],
            str(s.get("last_seen_at") or "never")[:19],
        )
    return table


def _hand_over(secret: str, what: str, token_file: Path | None, as_json: bool, answer: dict[str, Any]) -> None:
    """Write a new site token to `token_file` (mode 600), or print it once."""
    if token_file is not None:
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.touch(mode=0o600, exist_ok=False)
        token_file.write_text(secret + "\n")
        typer.echo(f"{what}; its token is in {token_file}")
    elif as_json:
        _emit(answer, True)
    else:
        typer.echo(f"{what}; its token (shown once): {secret}")


TokenFileOption = Annotated[
    Path | None, typer.Option(help="Write the site token to this file (mode 600) instead of printing it.")
]


def enroll_site(
    name: Annotated[str, typer.Argument(help="Site name: lowercase letters, digits, '.', '_' or '-'.")],
    token_file: TokenFileOption = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Enrol a site; its token is shown (or written) once."""
    with _api(url, token) as api:
        enrolled = api.enrol_site(name)
    _hand_over(enrolled["token"]["token"], f"enrolled site {name}", token_file, as_json, enrolled)


def rotate_site_token(
    name: Annotated[str, typer.Argument(help="Site name.")],
    token_file: TokenFileOption = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Issue a site a new token (after a revoke, or a leak); its older tokens are revoked at once."""
    with _api(url, token) as api:
        issued = api.rotate_site_token(name)
    _hand_over(issued["token"], f"new token for site {name}, older ones revoked", token_file, as_json, issued)


def list_sites(url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List enrolled sites: whether each has a live token, and when it was last seen."""
    with _api(url, token) as api:
        sites = api.sites()
        try:
            live = {t.get("site") for t in api.tokens() if t.get("site") and not t.get("revoked_at")}
        except ApiError as exc:
            if exc.status != 403:
                raise
            live = None  # tokens are the admin's to list: a researcher or viewer sees the sites without
    for site in sites:
        site["token"] = "?" if live is None else "live" if site["name"] in live else "revoked"
    _emit(sites, as_json, _sites_table)


def revoke_site(
    name: Annotated[str, typer.Argument(help="Site name.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Revoke every token of a site; its agent is refused from now on."""
    with _api(url, token) as api:
        live = [t for t in api.tokens() if t.get("site") == name and not t.get("revoked_at")]
        if not live:
            raise ApiError(f"site {name!r} has no live token")
        for t in live:
            api.revoke_token(t["id"])
    typer.echo(f"revoked {len(live)} token(s) of site {name}")


site_admin_app = typer.Typer(help="Enroll, list and revoke sites at the coordinator.", no_args_is_help=True)
site_admin_app.command("enroll")(enroll_site)
site_admin_app.command("list")(list_sites)
site_admin_app.command("token")(rotate_site_token)
site_admin_app.command("revoke")(revoke_site)


def _heads_text(model: dict) -> str:
    """'tiny 6:2', with each site's own split where the study gives sites their own (model.site_heads)."""
    own = ", ".join(f"{site} {split}" for site, split in sorted(model.get("site_heads", {}).items()))
    return f"{model['preset']} {model['heads']}" + (f" (per site: {own})" if own else "")
