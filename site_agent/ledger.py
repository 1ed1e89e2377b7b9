"""The site's secure-aggregation ledger: each theta^g it took part in a secure round from, each attempt it revealed in.

A coordinator that lies can difference two secure sums that share inputs. Within a round, a site
that sent its unmasking shares in one attempt takes part in no other attempt of that round (two
sums over different survivor sets). Across rounds and studies, a site never takes part in a secure
round from a theta^g it took part from before: its training seed depends on the study's seed, the
round and the site only, so the same model served again (in a later round, or in another study
with the same seed and initial model) would give bit-identical honest updates, and two sums over
different sites their difference. The honest retry of a round the site did not reveal in (the
same study and round, the next attempt) is the only exception.

Both live in one protected record of the encrypted store (`secure-ledger`, counted in the store and
outside it: site_agent/store_guard.py), so an older copy of the store, restored, is refused
(StaleStore) instead of forgetting either. The ledger names digests, studies and rounds only, and
stays at the site.
"""

from __future__ import annotations

from typing import Any

from site_agent.store import SiteStore

__all__ = ["LEDGER", "record_revealed", "record_use", "revealed_attempt", "used_from"]

LEDGER = "secure-ledger"
_LEGACY_REVEALED = "revealed"  # the per-study record of releases before the ledger (read, never written)


def _ledger(store: SiteStore) -> dict[str, Any]:
    record = store.load_protected(LEDGER) or {}
    return {"used": dict(record.get("used", {})), "revealed": dict(record.get("revealed", {}))}


def used_from(store: SiteStore, digest: str) -> tuple[str, int] | None:
    """(study, round) of the secure round this site took part in from theta^g `digest`, if any."""
    used = _ledger(store)["used"].get(digest)
    return (str(used[0]), int(used[1])) if used is not None else None


def record_use(store: SiteStore, study: str, round_: int, digest: str) -> None:
    """Keep that round `round_` of `study` is this site's secure round from theta^g `digest` (before it trains)."""
    ledger = _ledger(store)
    if ledger["used"].get(digest) == [study, round_]:
        return
    ledger["used"][digest] = [study, round_]
    store.save_protected(LEDGER, ledger)


def record_revealed(store: SiteStore, study: str, round_: int, attempt: int) -> None:
    """Keep that the site revealed its shares in `attempt` of round `round_` of `study` (before they leave)."""
    ledger = _ledger(store)
    ledger["revealed"].setdefault(study, {})[str(round_)] = attempt
    store.save_protected(LEDGER, ledger)


def revealed_attempt(store: SiteStore, study: str, round_: int) -> int | None:
    """The attempt of round `round_` of `study` whose unmasking shares this site sent, if any."""
    attempt = _ledger(store)["revealed"].get(study, {}).get(str(round_))
    if attempt is None:  # a round revealed before this release kept the ledger
        attempt = (store.load_record(_LEGACY_REVEALED, study) or {}).get(str(round_))
    return int(attempt) if attempt is not None else None
