"""What can go wrong for an agent, as a small tree; callers catch at the level they care about.

* AgentError
  + CoordinatorUnavailable   network error, timeout or 5xx: wait and retry with backoff
  + Unauthorized             403: the token may not do this (yet); keep the store, retry slowly
    + TokenRefused           401: the coordinator knows no such token (revoked or unknown): stop (a ConfigError too)
  + TaskRejected             another 4xx for a task (cancelled study, closed round): skip the task
  + TaskMismatch             a task disagrees with the terms this site's operator approved: decline it
    + TaskUnreadable         a task that is not a valid task of this protocol at all: decline it
  + IntegrityError           downloaded bytes do not match their announced sha256
  + UpgradeRequired          the coordinator and this agent speak protocols the other does not take: stop
  + ConfigError              a setting is missing or wrong; names the setting
    + WrongSite              the token belongs to another site than the configured `name`: stop
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "ConfigError",
    "CoordinatorUnavailable",
    "IntegrityError",
    "TaskMismatch",
    "TaskRejected",
    "TaskUnreadable",
    "TokenRefused",
    "Unauthorized",
    "UpgradeRequired",
    "WrongSite",
]


class AgentError(Exception):
    """Base for the agent's own errors."""


class CoordinatorUnavailable(AgentError):
    """The coordinator could not be reached or failed (network error, timeout, 5xx)."""


class Unauthorized(AgentError):
    """The coordinator refused the site token (revoked, rotated or wrong)."""


class TaskRejected(AgentError):
    """The coordinator refused a request about a task with a 4xx; `code` is its stable error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class TaskMismatch(AgentError):
    """A task (or a secure round's view) disagrees with the terms this site approved; the message says where."""


class TaskUnreadable(TaskMismatch):
    """The coordinator sent something that is not a valid task; `round_id` is its round, when it names one."""

    def __init__(self, message: str, round_id: int | None) -> None:
        super().__init__(message)
        self.round_id = round_id


class IntegrityError(AgentError):
    """Downloaded bytes do not match the sha256 the task announced."""


class UpgradeRequired(AgentError):
    """Coordinator and agent speak protocol versions the other does not take; the message says which to upgrade."""


class ConfigError(AgentError):
    """A setting is missing or invalid; the message names it."""


class TokenRefused(Unauthorized, ConfigError):
    """401: the coordinator knows this site's token no more (revoked) or never did; retrying cannot help."""


class WrongSite(ConfigError):
    """The coordinator says the token is another site's than the configured `name`."""
