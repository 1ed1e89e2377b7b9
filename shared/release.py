"""The release's version, as the installed package's metadata says it (pyproject.toml's `version`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["release_version"]


def release_version() -> str:
    """The installed cardiofl's version, e.g. "0.6.0"; "unknown" when run from a tree that was never installed."""
    try:
        return version("cardiofl")
    except PackageNotFoundError:
        return "unknown"
