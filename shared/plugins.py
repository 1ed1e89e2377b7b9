"""Plug-ins: rules any installed distribution registers through entry points, and the identity a study names.

A distribution registers a rule by an entry point in one of `GROUPS` (in its pyproject.toml:
`[project.entry-points."cardiofl.algorithms"] my_method = "my_package.module:RULE"`); cardiofl's
own built-ins are registered the same way, by its own pyproject.toml. `load_group` reads a group
once per process: name -> (the loaded object, the distribution that registered it); two
distributions registering one name is refused, never resolved by order.

A plug-in's identity (`PluginIdentity`) is its distribution's name, version and the sha256 of its
installed files: every path its RECORD lists except compiled bytecode (`.pyc`, `__pycache__/`) and
the files an installer writes for itself (RECORD, INSTALLER, REQUESTED, direct_url.json), each as
"path NUL sha256-of-bytes LF" in sorted path order, hashed whole; RECORD paths use "/" on every
platform, so the identity is the same wherever the same wheel is installed. A study's terms name the
identity of every plug-in they use; a site runs a plug-in only if its own installed copy has that
identity and was not installed in editable mode (whose files may change under it), and code never
travels from the coordinator: the operator installs it.

A plug-in whose distribution has no RECORD, an empty or unreadable one, one that lists none of its
files, or that lacks a file its RECORD lists has no identity (PluginIdentityError): it would hash
as nothing, alike to every other such plug-in, so the coordinator refuses a study that uses it, a
site refuses to approve or run one, and `cardiofl plugins list` shows why. cardiofl's own
distribution is exempt: no terms name it, and a source checkout's egg-info has no RECORD.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator, Mapping
from functools import cache, lru_cache
from importlib import metadata
from os import PathLike
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field

from shared.errors import PluginIdentityError, StudyRuleError

__all__ = [
    "GROUPS",
    "OWN_DISTRIBUTION",
    "InstalledPlugin",
    "PluginIdentity",
    "Registry",
    "installed_plugins",
    "forget_plugins",
    "load_group",
    "plugin_identity",
]

OWN_DISTRIBUTION = "cardiofl"  # the built-ins' distribution: versioned by the release and its protocol
# the entry-point groups cardiofl reads; `cardiofl.clients` (an algorithm's client side) only at a site
GROUPS = ("cardiofl.algorithms", "cardiofl.clients", "cardiofl.models", "cardiofl.sources")
_INSTALLER_FILES = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


class PluginIdentity(BaseModel):
    """Which installed distribution provides a rule: name, version and the hash of its installed files."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    distribution: str = Field(min_length=1, max_length=200)
    version: str = Field(min_length=1, max_length=100)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class InstalledPlugin(BaseModel):
    """One entry point as installed here: what `cardiofl plugins list` shows."""

    group: str
    name: str
    value: str  # "module:attribute"
    distribution: str  # the distribution that registers it, and its version (both in `identity` too, if any)
    version: str
    identity: PluginIdentity | None  # None: it has none, and `problem` says why (no RECORD ...)
    location: str  # where the distribution is installed
    editable: bool
    builtin: bool  # registered by cardiofl itself
    problem: str | None = None  # why it has no identity, and so is refused by studies and sites


def _counted(path: str) -> bool:
    """Whether a RECORD path is part of the identity: not bytecode, not an installer's own file."""
    parts = path.split("/")
    if path.endswith(".pyc") or "__pycache__" in parts:
        return False
    return not (len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] in _INSTALLER_FILES)


_REINSTALL = "its installed files cannot be identified, so cardiofl refuses it: reinstall it from a wheel with pip"


def _refusal(distribution: metadata.Distribution, what: str) -> PluginIdentityError:
    """The error of a distribution without an identity, naming it, where it lies, what is wrong and what to do."""
    name, version, location = distribution.metadata["Name"], distribution.version, distribution.locate_file("")
    return PluginIdentityError(f"plug-in distribution {name!r} {version} at {location} {what}: {_REINSTALL}")


def _record_files(distribution: metadata.Distribution) -> list[str]:
    """Every path the distribution's RECORD lists; PluginIdentityError without a RECORD that lists a file."""
    try:
        text = distribution.read_text("RECORD")
    except (OSError, UnicodeDecodeError) as exc:
        raise _refusal(distribution, f"has a RECORD file that cannot be read ({exc})") from None
    if text is None:
        raise _refusal(distribution, "has no RECORD file")
    if not text.strip():
        raise _refusal(distribution, "has an empty RECORD file")
    try:
        paths = [str(file) for file in distribution.files or ()]
    except (csv.Error, TypeError, ValueError) as exc:
        raise _refusal(distribution, f"has a RECORD file that cannot be read ({exc})") from None
    if not any(_counted(path) for path in paths):
        raise _refusal(distribution, "has a RECORD file that lists none of its files")
    return paths


def plugin_identity(distribution: metadata.Distribution) -> PluginIdentity:
    """The identity of an installed distribution (see the module): its name, version and files' hash.

    PluginIdentityError when a plug-in has none: no RECORD, an empty or unreadable one, or a file it
    lists cannot be read. cardiofl's own distribution is hashed over whatever files its metadata lists.
    """
    name = distribution.metadata["Name"]
    own = name == OWN_DISTRIBUTION
    files = [str(file) for file in distribution.files or ()] if own else _record_files(distribution)
    digest = hashlib.sha256()
    for path in sorted(path for path in files if _counted(path)):
        try:
            # typeshed's 3.11 SimplePath is no PathLike; an installed distribution's locate_file gives a Path
            content = Path(cast(PathLike[str], distribution.locate_file(path))).read_bytes()
        except OSError as exc:
            if own:
                raise
            reason = exc.strerror or exc
            raise _refusal(distribution, f"cannot read {path}, which its RECORD lists ({reason})") from None
        digest.update(f"{path}\0{hashlib.sha256(content).hexdigest()}\n".encode())
    return PluginIdentity(distribution=name, version=distribution.version, sha256=digest.hexdigest())


def is_editable(distribution: metadata.Distribution) -> bool:
    """Whether the distribution was installed in editable mode (PEP 660: direct_url.json says so)."""
    text = distribution.read_text("direct_url.json")
    if not text:
        return False
    try:
        return bool(json.loads(text).get("dir_info", {}).get("editable", False))
    except (ValueError, AttributeError):
        return False


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=group))


@cache
def load_group(group: str) -> Mapping[str, tuple[Any, metadata.Distribution]]:
    """Name -> (the object its entry point names, its distribution), every installed one of `group`, once."""
    found: dict[str, tuple[Any, metadata.Distribution]] = {}
    owners: dict[str, str] = {}
    for point in sorted(_entry_points(group), key=lambda p: (p.name, p.value)):
        distribution = point.dist
        if distribution is None:
            raise StudyRuleError(f"entry point {point.name!r} of {group} names no distribution")
        owner = distribution.metadata["Name"]
        if point.name in owners and owners[point.name] != owner:
            raise StudyRuleError(
                f"{group} {point.name!r} is registered by both {owners[point.name]!r} and {owner!r}: uninstall one"
            )
        owners[point.name] = owner
        found[point.name] = (point.load(), distribution)
    if not any(owner == OWN_DISTRIBUTION for owner in owners.values()) and group in GROUPS:
        raise StudyRuleError(
            f"no {group} entry point of {OWN_DISTRIBUTION!r}: install it (pip install . or -e .) so that its "
            "built-ins register"
        )
    return found


def installed_plugins() -> list[InstalledPlugin]:
    """Every entry point of every group, with its distribution's identity and where it lies."""
    out = []
    for group in GROUPS:
        identities: dict[str, PluginIdentity | PluginIdentityError] = {}
        for point in sorted(_entry_points(group), key=lambda p: p.name):
            distribution = point.dist
            if distribution is None:
                continue
            name = distribution.metadata["Name"]
            if name not in identities:
                try:
                    identities[name] = plugin_identity(distribution)
                except PluginIdentityError as exc:  # shown, not raised: the list is how an operator finds out
                    identities[name] = exc
            found = identities[name]
            out.append(
                InstalledPlugin(
                    group=group,
                    name=point.name,
                    value=point.value,
                    distribution=name,
                    version=distribution.version,
                    identity=found if isinstance(found, PluginIdentity) else None,
                    location=str(distribution.locate_file("")),
                    editable=is_editable(distribution),
                    builtin=name == OWN_DISTRIBUTION,
                    problem=str(found) if isinstance(found, PluginIdentityError) else None,
                )
            )
    return out


Rule = TypeVar("Rule")


@lru_cache(maxsize=64)
def _identity(distribution: metadata.Distribution) -> PluginIdentity:
    return plugin_identity(distribution)


def _show(identity: PluginIdentity) -> str:
    return f"{identity.distribution} {identity.version} (files {identity.sha256[:12]})"


class Registry(Mapping[str, Rule], Generic[Rule]):
    """name -> rule of every installed entry point of one group, read on first use, each checked to be a `rule`.

    One path for cardiofl's built-ins and any plug-in's: both are entry points of the group.
    """

    def __init__(self, group: str, rule: type[Rule], kind: str) -> None:
        self.group, self.rule, self.kind = group, rule, kind
        self._checked: Mapping[str, tuple[Any, metadata.Distribution]] | None = None

    def _rules(self) -> Mapping[str, tuple[Any, metadata.Distribution]]:
        rules = load_group(self.group)
        if rules is not self._checked:  # once per loading of the group, not per lookup
            for name, (rule, distribution) in rules.items():
                if not isinstance(rule, self.rule):
                    owner = distribution.metadata["Name"]
                    raise StudyRuleError(
                        f"{self.kind} {name!r} of {owner!r} is a {type(rule).__name__}, not a {self.rule.__name__}"
                    )
            self._checked = rules
        return rules

    def __getitem__(self, name: str) -> Rule:
        rule: Rule = self._rules()[name][0]
        return rule

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules())

    def __len__(self) -> int:
        return len(self._rules())

    def distribution(self, name: str) -> metadata.Distribution:
        """The distribution that registered `name`."""
        return self._rules()[name][1]

    def plugin(self, name: str) -> PluginIdentity | None:
        """The identity of the plug-in that provides `name` here; None for cardiofl's own.

        PluginIdentityError when the plug-in has none (no RECORD, an empty or unreadable one ...).
        """
        distribution = self.distribution(name)
        return None if distribution.metadata["Name"] == OWN_DISTRIBUTION else _identity(distribution)

    def problem(self, name: str, named: PluginIdentity | None) -> str | None:
        """Why `name` as installed here is not the plug-in `named` by a study's terms; None when it is.

        A built-in must be named by no plug-in; a plug-in must have an identity (a RECORD of its files),
        its distribution, version and files' hash must all equal the terms', and its installation must
        not be editable.
        """
        what = f"{self.kind} {name!r}"
        try:
            here = self.plugin(name)
        except PluginIdentityError as exc:
            return f"{what}: {exc}"
        if here is None:
            return None if named is None else f"{what} is built into cardiofl here; the terms name {_show(named)}"
        if named is None:
            return f"{what} is plug-in {_show(here)} here, and the terms name no plug-in for it"
        if is_editable(self.distribution(name)):
            return f"{what}'s plug-in {here.distribution!r} is installed editable here, which sites refuse"
        if here != named:
            return f"{what}: this site has {_show(here)}, the terms name {_show(named)}"
        return None


def forget_plugins() -> None:
    """Read every group afresh at the next lookup (after installing or removing a distribution in-process)."""
    load_group.cache_clear()
    _identity.cache_clear()
