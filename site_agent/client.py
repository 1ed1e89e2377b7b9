"""The agent's view of the coordinator's REST API; httpx errors are mapped here, once."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from shared.study.checks import check_study
from shared.wire.jobs import JobReport, SiteJob, jobs_url
from shared.wire.protocol import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    ApprovalReport,
    ErrorBody,
    StudyOffer,
    TaskDecline,
    TaskSpec,
    UpdateReceipt,
)
from shared.wire.secure import SecureRoundView
from site_agent.backoff import exponential, jitter
from site_agent.errors import (
    CoordinatorUnavailable,
    IntegrityError,
    TaskRejected,
    TaskUnreadable,
    TokenRefused,
    Unauthorized,
    UpgradeRequired,
    WrongSite,
)
from site_agent.kept_partials import KeptPartial, KeptPartials
from site_agent.partial_body import PartialBody
from site_agent.resumable_upload import UPLOAD_PIECE_BYTES, ResumableUpload, upload_pieces
from site_agent.tls import AgentTls
from site_agent.transfer_progress import TransferProgress

__all__ = ["DOWNLOAD_STALLS", "UPLOAD_PIECE_BYTES", "CoordinatorClient", "upload_pieces"]

log = logging.getLogger(__name__)

DOWNLOAD_STALLS = 5  # resumptions in a row that bring no new byte before a download gives up


class CoordinatorClient:
    """Typed calls to the site endpoints; the transport is injected (a TestClient works too)."""

    def __init__(
        self,
        http: httpx.Client,
        *,
        poll_wait_s: float = 30.0,
        tls: AgentTls | None = None,
        resume_delay_s: float = 1.0,
        download_dir: Path | None = None,
    ) -> None:
        self.http = http
        self.http.headers[PROTOCOL_HEADER] = str(PROTOCOL_VERSION)  # a coordinator refuses agents it no longer serves
        self.poll_wait_s = poll_wait_s
        self.tls = tls  # how `http` does TLS: it explains a refused handshake
        self.resume_delay_s = resume_delay_s  # the first wait before a cut download resumes, doubling while none helps
        # where downloads keep their bytes so far, for a restarted agent to go on from (None: in memory only)
        self.partials = KeptPartials(download_dir) if download_dir is not None else None
        self.bytes_sent = 0
        self.bytes_received = 0

    @contextmanager
    def _mapped_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except httpx.TransportError as exc:
            reason = self.tls.explain(exc, self._drops_new_connections) if self.tls is not None else None
            raise CoordinatorUnavailable(f"{what}: {reason or f'{type(exc).__name__}: {exc}'}") from exc

    def _drops_new_connections(self) -> bool:
        """Whether the coordinator closes a fresh HTTPS connection without answering (mutual TLS refusing us)."""
        if self.http.base_url.scheme != "https":
            return False
        try:
            self.http.get("/api/v1/health", timeout=10.0)
        except httpx.RemoteProtocolError:
            return True
        except httpx.TransportError:
            return False
        return False

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code < 400 or response.status_code == 304:
            return response
        try:
            info = ErrorBody.model_validate_json(response.content).error
            code, message = info.code, info.message
        except ValueError:
            code, message = "http_error", response.text[:200]
        if response.status_code >= 500 or response.status_code == 429:
            raise CoordinatorUnavailable(f"{what}: {response.status_code} {code}: {message}")
        if response.status_code == 426:
            raise UpgradeRequired(f"{what}: {message}")
        if response.status_code == 401:
            raise TokenRefused(
                f"the coordinator refused this site's token (revoked or unknown) {what} ({message}): ask its "
                "operator for a new one, then put it in setting 'token' / 'token_file' (CARDIOFL_SITE_TOKEN or "
                "CARDIOFL_SITE_TOKEN_FILE) and start the agent again"
            )
        if response.status_code == 403:
            raise Unauthorized(f"{what}: {response.status_code} {code}: {message}")
        raise TaskRejected(response.status_code, code, message)

    def own_site(self) -> str:
        """GET /sites/me: the name of the site the token belongs to."""
        with self._mapped_errors("asking which site this token is"):
            response = self.http.get("/api/v1/sites/me")
        self._check(response, "asking which site this token is")
        self.bytes_received += len(response.content)
        return str(response.json()["name"])

    def check_site(self, site: str) -> None:
        """The token must be `site`'s: WrongSite (naming setting 'name') when the coordinator knows it as another's."""
        owner = self.own_site()
        if owner != site:
            raise WrongSite(
                f"setting 'name': this agent is configured as site {site!r}, "
                f"but its token belongs to site {owner!r}; fix `name` or the token"
            )

    def health(self) -> None:
        """GET /health (no token): the coordinator answers over this client's TLS."""
        with self._mapped_errors("reaching the coordinator"):
            response = self.http.get("/api/v1/health")
        self._check(response, "reaching the coordinator")

    def offers(self, *, finished: bool = False) -> list[StudyOffer]:
        """GET /sites/me/studies: the studies that list this site (with `finished`, also those that ended)."""
        what = "listing the studies offered to this site"
        with self._mapped_errors(what):
            response = self.http.get("/api/v1/sites/me/studies", params={"finished": finished})
        self._check(response, what)
        self.bytes_received += len(response.content)
        offers = []
        for item in response.json()["data"]:
            try:
                offer = StudyOffer.model_validate(_known_protocol(item))
            except ValidationError as exc:  # one study this release cannot read: the others still count
                study = item.get("study_id") if isinstance(item, dict) else None
                log.warning("study %s: its offer is not valid, skipped: %s", study, _first_errors(exc))
                continue
            problems = check_study(offer.terms)
            if problems:  # terms that cannot run here (an unknown algorithm, a threshold a hub could split ...)
                shown = "; ".join(str(problem) for problem in problems[:3])
                log.warning("study %s: its offer's terms are not valid, skipped: %s", offer.study_id, shown)
                continue
            offers.append(offer)
        return offers

    def jobs(self) -> list[SiteJob]:
        """GET /jobs: this site's due jobs (surveys, external validations, evaluations), oldest study first.

        A job this release cannot read, or whose terms cannot run here, is logged and left out, as an offer is.
        """
        what = "listing this site's jobs"
        with self._mapped_errors(what):
            response = self.http.get(jobs_url())
        self._check(response, what)
        self.bytes_received += len(response.content)
        raw = response.json()
        items = raw.get("data", []) if isinstance(raw, dict) else raw
        jobs = []
        for item in items if isinstance(items, list) else []:
            try:
                job = SiteJob.model_validate(_known_protocol(item) if isinstance(item, dict) else item)
            except ValidationError as exc:
                study = item.get("study_id") if isinstance(item, dict) else None
                log.warning("study %s: a job is not valid, skipped: %s", study, _first_errors(exc))
                continue
            problems = check_study(job.terms)
            if problems:
                shown = "; ".join(str(problem) for problem in problems[:3])
                log.warning("study %s: its job's terms are not valid, skipped: %s", job.study_id, shown)
                continue
            jobs.append(job)
        return jobs

    def report(self, url: str, report: JobReport) -> dict[str, Any]:
        """POST a job's report as JSON (the same report again is a no-op); the coordinator's answer.

        A refusal (4xx) raises TaskRejected, as for an upload.
        """
        what = f"reporting to {url}"
        body = report.model_dump_json().encode()
        with self._mapped_errors(what):
            response = self.http.post(url, content=body, headers={"Content-Type": "application/json"})
        self._check(response, what)
        self.bytes_sent += len(body)
        answer = response.json() if response.content else {}
        return answer if isinstance(answer, dict) else {"answer": answer}

    def register_signing_key(self, public_key: str) -> None:
        """PUT the site's long-term Ed25519 public key (hex): secure studies' terms name it."""
        what = "registering this site's signing key"
        with self._mapped_errors(what):
            response = self.http.put("/api/v1/sites/me/signing-key", json={"public_key": public_key})
        self._check(response, what)

    def report_approval(self, study_id: int, report: ApprovalReport) -> None:
        """PUT the operator's decision on a study (as this site's digest of it) to the coordinator."""
        what = f"reporting the approval state of study {study_id}"
        with self._mapped_errors(what):
            response = self.http.put(
                f"/api/v1/sites/me/studies/{study_id}/approval", json=report.model_dump(mode="json")
            )
        self._check(response, what)

    def next_task(self, *, wait_s: float | None = None) -> TaskSpec | None:
        """Long-poll (`wait_s`, default poll_wait_s) for this site's next task; None when there is nothing to do."""
        wait = self.poll_wait_s if wait_s is None else wait_s
        with self._mapped_errors("polling for a task"):
            response = self.http.get(
                "/api/v1/tasks/next", params={"wait": wait}, timeout=httpx.Timeout(30.0, read=wait + 30.0)
            )
        self._check(response, "polling for a task")
        self.bytes_received += len(response.content)
        if response.status_code == 204:
            return None
        raw = response.json()
        if not isinstance(raw, dict):
            raise TaskUnreadable("the task is not a JSON object", None)
        round_id = raw.get("round_id")
        known = round_id if isinstance(round_id, int) and not isinstance(round_id, bool) else None
        try:
            task = TaskSpec.model_validate(_known_protocol(raw))
        except ValidationError as exc:
            raise TaskUnreadable(_first_errors(exc), known) from None
        problems = check_study(task.terms)
        if problems:
            raise TaskUnreadable("; ".join(f"terms.{problem}" for problem in problems[:3]), known)
        return task

    def decline(self, url: str, reason: str) -> None:
        """POST that this site will not do a round's task, and why (the same decline again is a no-op)."""
        what = f"declining the task at {url}"
        body = TaskDecline(reason=reason[:2_000]).model_dump_json().encode()
        with self._mapped_errors(what):
            response = self.http.post(url, content=body, headers={"Content-Type": "application/json"})
        self._check(response, what)
        self.bytes_sent += len(body)

    def download(self, url: str, sha256: str) -> bytearray:
        """GET a tensor blob into a buffer of its announced length, hashing it as it arrives; verify the digest.

        The buffer is the agent's own, so the tensors decoded from it view it (shared.tensors.codec.load):
        past the HTTP library, the model's bytes are copied once, as they arrive, into this buffer
        (they were joined into one body, then copied again by the decoder).

        A transfer cut after some bytes resumes where it stopped (`Range: bytes=N-`, `If-Range: <ETag>`),
        the hash going on over the new bytes; an answer of the whole body instead (the coordinator
        ignored the range, or the blob changed) starts again from byte 0. After DOWNLOAD_STALLS
        resumptions in a row that bring no new byte, the download fails as any unreachable coordinator.

        With a `download_dir`, the bytes are also kept on disk as they arrive (site_agent/kept_partials.py),
        so that a restarted agent asks only for the rest. Kept bytes that do not hash to `sha256` with the
        rest (or whose rest the coordinator cannot send) are thrown away and the download starts over once.
        """
        kept = self.partials.open(sha256) if self.partials is not None else None
        ended = False  # well, or with bytes that are not the blob's: either way nothing is left to keep
        try:
            with self._mapped_errors(f"downloading {url}"):
                partial = self._kept_bytes(url, kept)
                try:
                    self._fetch(url, partial, kept)
                    if partial.adopted and partial.sha256 != sha256:
                        raise IntegrityError(f"the bytes kept do not hash to {sha256}")
                except (IntegrityError, TaskRejected) as exc:
                    if not partial.adopted or (isinstance(exc, TaskRejected) and exc.status != 416):
                        raise
                    log.warning("download of %s: %s; starting over from byte 0", url, exc)
                    partial = PartialBody()
                    self._fetch(url, partial, kept)
            body = partial.finished()
            ended = True
            if partial.sha256 != sha256:
                raise IntegrityError(f"{url}: sha256 {partial.sha256} differs from the announced {sha256}")
            return body
        except IntegrityError:
            ended = True
            raise
        finally:
            if kept is not None:
                if ended:
                    kept.discard()
                kept.close()

    def _kept_bytes(self, url: str, kept: KeptPartial | None) -> PartialBody:
        """What a download holds before its first request: the bytes kept from an earlier start, if any."""
        partial = PartialBody()
        try:
            held = kept.load(partial) if kept is not None else 0
        except (OSError, MemoryError) as exc:  # unreadable, or a size no buffer holds: not the blob's bytes
            log.warning("download of %s: the bytes kept from an earlier start are unusable (%r); dropped", url, exc)
            assert kept is not None
            kept.discard()
            return PartialBody()
        if held:
            log.info(
                "download of %s: %d of %d bytes kept from an earlier start; asking for the rest",
                url, partial.filled, partial.size,
            )  # fmt: skip
        return partial

    def _fetch(self, url: str, partial: PartialBody, kept: KeptPartial | None) -> None:
        """GET the bytes `partial` lacks into it (and `kept`), resuming after cuts; gives up as `download` says."""
        if partial.adopted and partial.complete:
            return  # kept whole before a restart: only the digest is left to check
        progress = TransferProgress(log, f"download of {url}", partial.size)
        stalls, delays = 0, self._resume_delays()
        while True:
            before = partial.filled
            cut: httpx.TransportError | None = None
            try:
                self._receive(url, partial, kept, progress)
            except httpx.TransportError as exc:
                cut = exc
            if cut is None and partial.complete:
                progress.finish()
                return
            if partial.filled > before:
                stalls, delays = 0, self._resume_delays()
            else:
                stalls += 1
            if partial.filled == 0 or stalls >= DOWNLOAD_STALLS:
                if cut is not None:
                    raise cut
                return  # a body shorter than announced, again and again: the digest check refuses it
            delay = jitter(next(delays))
            log.info(
                "download of %s cut after %d of %d bytes (%s); resuming from there in %.1fs",
                url, partial.filled, partial.size, cut or "the body ended early", delay,
            )  # fmt: skip
            time.sleep(delay)

    def _resume_delays(self) -> Iterator[float]:
        """The waits before a download's resumptions: resume_delay_s, doubling up to 30 s (the caller jitters them)."""
        return exponential(self.resume_delay_s, max_delay=max(30.0, self.resume_delay_s))

    def _receive(self, url: str, partial: PartialBody, kept: KeptPartial | None, progress: TransferProgress) -> None:
        """One GET of the bytes `partial` lacks (at first all of them), added to it (and `kept`) as they arrive."""
        asked = partial.resume_headers()
        with self.http.stream("GET", url, headers=asked, timeout=httpx.Timeout(30.0, read=600.0)) as response:
            if response.status_code >= 400:
                response.read()
                self._check(response, f"downloading {url}")
            if response.status_code != 206 or not asked:
                if partial.filled:
                    log.info("%s: the coordinator sent the whole body again; starting over from byte 0", url)
                partial.restart(int(response.headers.get("content-length", "-1")), response.headers.get("etag"))
                if kept is not None:
                    kept.begin(partial.size, partial.etag)
            elif not partial.continues(response.headers.get("content-range")):
                raise IntegrityError(
                    f"{url}: asked for the bytes from {partial.filled}, got {response.headers.get('content-range')}"
                )
            progress.restart(partial.size, partial.filled)
            for chunk in response.iter_bytes():  # as they arrive: re-chunking would copy them
                partial.add(chunk)
                if kept is not None:
                    kept.append(chunk)
                self.bytes_received += len(chunk)
                progress.advance(partial.filled)

    def upload(self, url: str, body: bytes | bytearray, *, resuming: bool = False) -> UpdateReceipt:
        """POST an update (safetensors bytes with UpdateMeta in the header): its receipt.

        A transfer cut on the way resumes from the bytes the coordinator holds (site_agent/resumable_upload.py);
        with `resuming` (a pending upload re-sent after a restart), the agent asks for them first.
        """
        what = f"uploading to {url}"
        upload = ResumableUpload(self.http, self._check, resume_delay_s=self.resume_delay_s)
        with self._mapped_errors(what):
            receipt = upload.send(url, body, resuming=resuming)
        self.bytes_sent += len(body)
        return receipt

    def secure_round(self, url: str, *, wait: bool = False) -> SecureRoundView:
        """GET a secure round's phase and what is relayed to this site; with `wait`, long-poll for its next move."""
        what = f"reading the secure round at {url}"
        wait_s = self.poll_wait_s if wait else 0.0
        with self._mapped_errors(what):
            response = self.http.get(url, params={"wait": wait_s}, timeout=httpx.Timeout(30.0, read=wait_s + 30.0))
        self._check(response, what)
        self.bytes_received += len(response.content)
        return SecureRoundView.model_validate_json(response.content)

    def post_secure(self, url: str, message: BaseModel) -> None:
        """POST this site's message of a secure round's phase (the same message again is a no-op)."""
        what = f"sending to {url}"
        body = message.model_dump_json().encode()
        with self._mapped_errors(what):
            response = self.http.post(url, content=body, headers={"Content-Type": "application/json"})
        self._check(response, what)
        self.bytes_sent += len(body)


def _first_errors(exc: ValidationError, count: int = 3) -> str:
    """The first few errors of a validation, with their paths, in one line."""
    errors = exc.errors(include_url=False)
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(body)'}: {e['msg']}" for e in errors[:count])
    return shown + (f" (and {len(errors) - count} more)" if len(errors) > count else "")


def _known_protocol(task: dict[str, Any]) -> dict[str, Any]:
    """The task (or offer), if this agent speaks its protocol version (absent: 1); else UpgradeRequired."""
    version = task.get("protocol", 1)
    if isinstance(version, int) and MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        return task
    older = isinstance(version, int) and version < MIN_PROTOCOL_VERSION
    upgrade = "the coordinator" if older else "the site agent (cardiofl) to the coordinator's release"
    raise UpgradeRequired(
        f"the coordinator sends tasks of protocol {version!r} and this agent speaks {MIN_PROTOCOL_VERSION} to "
        f"{PROTOCOL_VERSION}: upgrade {upgrade}"
    )
