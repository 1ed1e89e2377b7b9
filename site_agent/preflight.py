"""`cardiofl site check`: everything the agent checks at start, and more, as one report of named checks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch

from shared.labels import CLASS_NAMES
from shared.model.network import build_model, preset
from site_agent.client import CoordinatorClient
from site_agent.config import (
    AgentSettings,
    check_settings,
    check_tls,
    load_settings,
    open_data,
    open_store,
    read_token,
    runtime_of,
    store_key,
)
from site_agent.errors import ConfigError, CoordinatorUnavailable, Unauthorized, UpgradeRequired, WrongSite
from site_agent.store import StoreError
from site_agent.tls import http_client

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "CHECKS",
    "Check",
    "CheckResult",
    "Preflight",
    "Status",
    "as_json",
    "connect",
    "is_ready",
    "render",
    "run_checks",
]

BATCH_RECORDS = 8  # records per timed training step
TIMED_STEPS = 3  # after one warm-up step


class Status(StrEnum):
    """How a check went; only `failed` makes the site not ready (`skipped`: a check it needs failed)."""

    OK = "ok"
    WARNING = "warning"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass
class CheckResult:
    """One check's outcome: a one-line detail, maybe more lines, and fields for automation."""

    name: str
    status: Status
    detail: str
    lines: list[str] = field(default_factory=list)  # shown under the table, e.g. per data source
    info: dict[str, Any] = field(default_factory=dict)  # extra JSON fields

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: name, status, detail, then the lines and the check's own fields."""
        return {"name": self.name, "status": self.status.value, "detail": self.detail, "lines": self.lines, **self.info}


def connect(settings: AgentSettings) -> httpx.Client:
    """The agent's own HTTP client of the coordinator: its URL, token and TLS context."""
    return http_client(str(settings.coordinator_url), read_token(settings), settings.tls, timeout=10.0)


@dataclass
class Preflight:
    """What the checks share: the config, the settings once loaded, and how to reach the coordinator."""

    config: Path | None
    preset: str = "small"
    batch: int = BATCH_RECORDS
    connect: Callable[[AgentSettings], httpx.Client] | None = None  # None: the agent's own client
    settings: AgentSettings | None = None

    @property
    def loaded(self) -> AgentSettings:
        """The settings; the checks that need them run only after they loaded."""
        assert self.settings is not None
        return self.settings


class Warned(Exception):
    """A check passed with a caveat: the message says what to look at."""


@dataclass(frozen=True)
class Check:
    """A named check; it runs only when every check in `needs` did not fail."""

    name: str
    run: Callable[[Preflight], CheckResult | str]  # a detail (ok), or a whole result
    needs: tuple[str, ...] = ()


@contextmanager
def _warnings_logged(into: list[str]) -> Iterator[None]:
    """Collect what the agent's code logs at WARNING or above (a certificate ending soon) while a check runs."""

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            into.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("site_agent")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _settings(pre: Preflight) -> str:
    pre.settings = load_settings(pre.config)
    check_settings(pre.settings)  # the agent's own start checks, in its order
    return f"site {pre.settings.name!r}, coordinator {pre.settings.coordinator_url}, {len(pre.settings.data)} source(s)"


def _store(pre: Preflight) -> str:
    settings = pre.loaded
    key = store_key(settings)  # a key file readable by others is refused here
    existing = (settings.store_dir / "keycheck.enc").exists()
    store = open_store(settings, key)
    pending = store.pending_studies()
    state = "opens with the key" if existing else "created with the key (a new store)"
    return f"{settings.store_dir} {state}; {len(pending)} pending upload(s)"


def _tls(pre: Preflight) -> str:
    settings = pre.loaded
    check_tls(settings)
    if settings.coordinator_url.scheme != "https":
        raise Warned(f"setting 'coordinator_url' is plain HTTP ({settings.coordinator_url}): no TLS")
    if not settings.verify_tls:
        raise Warned("setting 'verify_tls' is off: the coordinator's certificate is not checked")
    trusted = f"CA bundle {settings.ca_bundle}" if settings.ca_bundle else "the default trust store"
    mutual = f", client certificate {settings.client_cert}" if settings.client_cert else ""
    return f"trusts {trusted}{mutual}"


def _data(pre: Preflight) -> CheckResult:
    site = open_data(pre.loaded)
    report = site.report
    lines = [
        f"data.{index} {line.strip()}" for index, source in enumerate(report.sources) for line in source.summary_lines()
    ]
    labels = [sum(s.label_counts[i] for s in report.sources) for i in range(len(CLASS_NAMES))]
    skipped = sum(report.skipped.values())
    detail = (
        f"{len(report.sources)} source(s): loaded {report.loaded} (train {len(site.train)}, test {len(site.test)}), "
        f"skipped {skipped}, {sum(1 for n in labels if n)} class(es) labelled"
    )
    info = {
        "loaded": report.loaded,
        "skipped": report.skipped,
        "labels": {name: n for name, n in zip(CLASS_NAMES, labels, strict=True) if n},
        "sources": report.to_dict()["sources"],
    }
    status = Status.WARNING if skipped else Status.OK
    if skipped:
        detail += f" ({', '.join(f'{reason} {n}' for reason, n in report.skipped.items())})"
    return CheckResult("data", status, detail, lines, info)


def _coordinator(pre: Preflight) -> str:
    settings = pre.loaded
    with (pre.connect or connect)(settings) as http:
        client = CoordinatorClient(http, tls=settings.tls)
        client.health()
        try:
            client.check_site(settings.name)
        except Unauthorized as exc:
            raise ConfigError(
                f"setting 'token' / 'token_file': the coordinator refused the token (revoked or rotated?): {exc}"
            ) from None
    return f"{settings.coordinator_url} answers; the token is site {settings.name!r}'s"


def _device(pre: Preflight) -> CheckResult:
    runtime = runtime_of(pre.loaded)
    device = runtime.device
    memory = ""
    if device.type == "cuda":
        memory = f", {torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB"
    config = preset(pre.preset)
    model = build_model(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(pre.batch, config.n_leads, config.signal_len, device=device)
    y = (torch.rand(pre.batch, config.n_classes, device=device) < 0.2).float()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with runtime.autocast():
            logits = model(x)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y)
        torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up: allocation, kernel selection
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    ms = (time.perf_counter() - start) * 1000 / TIMED_STEPS
    shape = f"{pre.batch}x{config.n_leads}x{config.signal_len}"
    detail = f"{runtime.describe()}{memory}; preset {pre.preset!r}, batch {shape}: {ms:.0f} ms/step"
    info = {"device": runtime.describe() + memory, "preset": pre.preset, "batch": pre.batch, "ms_per_step": ms}
    return CheckResult("device", Status.OK, detail, info=info)


CHECKS: tuple[Check, ...] = (
    Check("settings", _settings),
    Check("store", _store, needs=("settings",)),
    Check("tls", _tls, needs=("settings",)),
    Check("data", _data, needs=("settings",)),
    Check("coordinator", _coordinator, needs=("settings", "tls")),
    Check("device", _device, needs=("settings",)),
)


def _failure(exc: Exception) -> str:
    """One line for a check's error: the first line of its message, with the kind of error where it helps."""
    if isinstance(exc, CoordinatorUnavailable):
        prefix = "unreachable: "
    elif isinstance(exc, UpgradeRequired):
        prefix = "agent and coordinator versions differ: "
    else:
        prefix = ""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return prefix + (text or type(exc).__name__)


def _run_one(check: Check, pre: Preflight) -> CheckResult:
    logged: list[str] = []
    try:
        with _warnings_logged(logged):
            outcome = check.run(pre)
    except Warned as exc:
        return CheckResult(check.name, Status.WARNING, str(exc))
    except (ConfigError, StoreError, CoordinatorUnavailable, UpgradeRequired, WrongSite) as exc:
        return CheckResult(check.name, Status.FAILED, _failure(exc))
    except Exception as exc:  # noqa: BLE001 - a report of every check, whatever one of them raised
        return CheckResult(check.name, Status.FAILED, f"{type(exc).__name__}: {_failure(exc)}")
    result = outcome if isinstance(outcome, CheckResult) else CheckResult(check.name, Status.OK, outcome)
    if logged and result.status is Status.OK:
        result.status = Status.WARNING
        result.lines.extend(logged)
        result.detail += f"; {logged[0]}"
    return result


def run_checks(pre: Preflight, checks: tuple[Check, ...] = CHECKS) -> list[CheckResult]:
    """Every check in order; one whose needs failed or were skipped is skipped, the others run anyway."""
    results: dict[str, CheckResult] = {}
    for check in checks:
        blocked = [n for n in check.needs if results[n].status in (Status.FAILED, Status.SKIPPED)]
        if blocked:
            results[check.name] = CheckResult(check.name, Status.SKIPPED, f"needs {', '.join(blocked)}")
        else:
            results[check.name] = _run_one(check, pre)
    return list(results.values())


def is_ready(results: list[CheckResult]) -> bool:
    """Ready when no check failed or was skipped (warnings allowed)."""
    return all(r.status in (Status.OK, Status.WARNING) for r in results)


def as_json(results: list[CheckResult]) -> dict[str, Any]:
    """The report for automation: {"ready": bool, "checks": [...]}."""
    return {"ready": is_ready(results), "checks": [r.to_dict() for r in results]}


STYLES = {Status.OK: "green", Status.WARNING: "yellow", Status.FAILED: "bold red", Status.SKIPPED: "dim"}


def render(results: list[CheckResult], console: Console) -> None:
    """The report as a table, the checks' extra lines, and the verdict."""
    from rich.text import Text

    from shared.tables import Table

    table = Table(show_header=True, header_style="bold")
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for r in results:
        table.add_row(r.name, Text(r.status.value, style=STYLES[r.status]), r.detail)
    console.print(table)
    for r in results:
        for line in r.lines:
            console.print(line, highlight=False, markup=False)
    verdict = "[green]ready[/]" if is_ready(results) else "[bold red]not ready[/]: fix the failed checks above"
    console.print(f"site {verdict}")
