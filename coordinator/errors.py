"""Errors the API reports; each class carries its HTTP status and a stable code, and one handler turns them into JSON.

* CoordinatorError            500 internal_error
  + Unauthenticated           401 unauthenticated
  + Forbidden                 403 forbidden
    - NotAParticipant         403 not_a_participant (to a site, for an unknown study or round too)
  + NotFound                  404 not_found (never to a site asking about a study or round: 403 then)
  + Conflict                  409 conflict
    - AlreadyExists           409 already_exists
    - InvalidTransition       409 invalid_transition
    - RoundClosed             409 round_closed
    - UpdateConflict          409 update_conflict
    - UpdateTooStale          409 update_too_stale (a buffered study's update more than max_staleness behind)
    - OffsetMismatch          409 upload_offset_mismatch, upload_session_busy (with the session's Upload-Offset)
    - WrongPhase              409 wrong_phase, not_a_secure_round, duplicate_message (secure rounds)
    - JobNotDue               409 job_not_due, wrong_job, not_approved, study_not_running, round_not_due (site jobs)
    - ReportConflict          409 report_conflict
    - WrongStudyKind          409 wrong_study_kind
  + PayloadTooLarge           413 payload_too_large
  + UnsupportedMediaType      415 unsupported_media_type
  + RangeNotSatisfiable       416 range_not_satisfiable (a download's Range lies outside the blob, or is invalid)
  + AgentTooOld               426 agent_too_old
  + Unprocessable             422 invalid_request
    - InvalidUpload           422 <the shared.tensors.codec PayloadError code>, invalid_update_meta, invalid_metrics,
                                  digest_mismatch (an upload session's bytes are not the announced sha256)
    - UnknownSites            422 unknown_sites
    - InvalidSecAggMessage    422 invalid_secagg_message
    - InvalidReport           422 invalid_report, report_mismatch
  + BufferReleasing           503 buffer_releasing (a buffered study is releasing its next version: send again)
"""

from __future__ import annotations

__all__ = [
    "AgentTooOld",
    "AlreadyExists",
    "BufferReleasing",
    "Conflict",
    "CoordinatorError",
    "Forbidden",
    "InvalidTransition",
    "InvalidSecAggMessage",
    "InvalidReport",
    "InvalidUpload",
    "JobNotDue",
    "NotAParticipant",
    "NotFound",
    "OffsetMismatch",
    "PayloadTooLarge",
    "RangeNotSatisfiable",
    "ReportConflict",
    "RoundClosed",
    "Unauthenticated",
    "UnknownSites",
    "UnsupportedMediaType",
    "Unprocessable",
    "UpdateConflict",
    "UpdateTooStale",
    "WrongPhase",
    "WrongStudyKind",
]


class CoordinatorError(Exception):
    """Base of the errors reported to callers as {"error": {"code", "message"}}."""

    status_code = 500
    code = "internal_error"
    headers: dict[str, str] | None = None  # sent with the error body

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class AgentTooOld(CoordinatorError):
    """The site agent speaks an older protocol than this coordinator serves: upgrade the agent."""

    status_code = 426
    code = "agent_too_old"


class Unauthenticated(CoordinatorError):
    """No token, an unknown token, or a revoked one."""

    status_code = 401
    code = "unauthenticated"


class Forbidden(CoordinatorError):
    """The token's role may not do this, or not to this resource."""

    status_code = 403
    code = "forbidden"


class NotAParticipant(Forbidden):
    """The site is not part of this study or round: a site is told so alike whether or not such a one exists.

    A site learns nothing of the studies and rounds of others, not even whether an id names one:
    `of_round` and `of_study` are the one refusal of each, for an unknown id as for another's.
    """

    code = "not_a_participant"

    @classmethod
    def of_round(cls, site: str | None, round_id: int) -> NotAParticipant:
        """The refusal of `site` asking about round `round_id`: not selected for it, or no such round."""
        return cls(f"site {site!r} was not selected for round {round_id}")

    @classmethod
    def of_study(cls, site: str | None, study_id: int) -> NotAParticipant:
        """The refusal of `site` asking about study `study_id`: not one of its sites, or no such study."""
        return cls(f"site {site!r} is not enrolled in study {study_id}")


class NotFound(CoordinatorError):
    """No such resource (or none the caller may see)."""

    status_code = 404
    code = "not_found"


class Conflict(CoordinatorError):
    """The request contradicts the current state."""

    status_code = 409
    code = "conflict"


class AlreadyExists(Conflict):
    """A resource with that name exists."""

    code = "already_exists"


class InvalidTransition(Conflict):
    """The study or round is not in a state that allows this change."""

    code = "invalid_transition"


class RoundClosed(Conflict):
    """The round stopped accepting updates (aggregating, completed, failed or cancelled)."""

    code = "round_closed"


class UpdateTooStale(Conflict):
    """A buffered study's update trained from a version more than `max_staleness` behind the open buffer's."""

    code = "update_too_stale"


class UpdateConflict(Conflict):
    """The site already has an accepted update for the round, with different bytes."""

    code = "update_conflict"


class OffsetMismatch(Conflict):
    """A chunk of an upload session does not start at the byte the coordinator holds up to, or one is arriving."""

    code = "upload_offset_mismatch"

    def __init__(self, message: str, offset: int, *, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.offset = offset
        self.headers = {"Upload-Offset": str(offset)}


class WrongPhase(Conflict):
    """A secure round's message arrived in another phase, twice with other content, or for a plain round."""

    code = "wrong_phase"


class JobNotDue(Conflict):
    """The study has no such job for the site now: not its kind or role, not approved, not running, a round not due."""

    code = "job_not_due"


class ReportConflict(Conflict):
    """The site already reported this job, with another body."""

    code = "report_conflict"


class WrongStudyKind(Conflict):
    """The study is of another kind (train, survey, evaluate) than the request needs."""

    code = "wrong_study_kind"


class PayloadTooLarge(CoordinatorError):
    """The body exceeds the configured size limit."""

    status_code = 413
    code = "payload_too_large"


class UnsupportedMediaType(CoordinatorError):
    """The body's content type is not the one the endpoint takes."""

    status_code = 415
    code = "unsupported_media_type"


class RangeNotSatisfiable(CoordinatorError):
    """A download's Range header asks for bytes outside the blob, or is not a valid byte range."""

    status_code = 416
    code = "range_not_satisfiable"

    def __init__(self, asked: str, size: int) -> None:
        super().__init__(f"Range {asked[:100]!r} is no range of bytes within the {size} bytes of this download")
        self.headers = {"Content-Range": f"bytes */{size}"}


class DatabaseUnavailable(CoordinatorError):
    """The coordinator's database does not answer."""

    status_code = 503
    code = "database_unavailable"


class BufferReleasing(CoordinatorError):
    """A buffered study is releasing its next version: an update arriving now joins the next buffer once it opens."""

    status_code = 503
    code = "buffer_releasing"

    def __init__(self, message: str, retry_after_s: int = 2) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}


class Unprocessable(CoordinatorError):
    """The request is well-formed HTTP but its content is refused."""

    status_code = 422
    code = "invalid_request"


class InvalidUpload(Unprocessable):
    """An update or a model file was refused before anything was stored; `code` names the reason."""

    code = "invalid_upload"


class UnknownSites(Unprocessable):
    """A study names sites that are not enrolled."""

    code = "unknown_sites"


class InvalidSecAggMessage(Unprocessable):
    """A secure round's message breaks the protocol (shares to non-neighbours, reveals not asked for ...)."""

    code = "invalid_secagg_message"


class InvalidReport(Unprocessable):
    """A job's report contradicts its path or the study's terms (its release, privacy.min_records, adaptation)."""

    code = "invalid_report"
