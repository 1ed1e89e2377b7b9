"""The site's long-term signing identity and what it revealed in secure rounds, both kept in its encrypted store.

The identity (Ed25519, shared/privacy/signing.py) is made at the agent's first start and registered
with the coordinator (PUT /sites/me/signing-key); a secure study's terms name its public key, so a
coordinator that substitutes it changes the digest the site approves. A site that sent its
unmasking shares for a round never takes part in another attempt of that round: two sums over
different survivor sets would let the coordinator difference them (the record says which attempt).
"""

from __future__ import annotations

from shared.privacy.signing import SiteIdentity
from site_agent.store import SiteStore

__all__ = ["record_revealed", "revealed_attempt", "site_identity"]

_IDENTITY = "identity"
_REVEALED = "revealed"


def site_identity(store: SiteStore) -> SiteIdentity:
    """The site's signing identity: the one in its store, or a new one, kept there at once."""
    record = store.load_record(_IDENTITY)
    if record is not None:
        return SiteIdentity.from_private_bytes(bytes.fromhex(record["private_key"]))
    identity = SiteIdentity.generate()
    store.save_record(_IDENTITY, {"private_key": identity.private_bytes().hex(), "public_key": identity.public_hex()})
    return identity


def record_revealed(store: SiteStore, study: str, round_: int, attempt: int) -> None:
    """Keep that the site revealed its shares in `attempt` of round `round_` of `study` (before they leave)."""
    record = store.load_record(_REVEALED, study) or {}
    record[str(round_)] = attempt
    store.save_record(_REVEALED, record, study)


def revealed_attempt(store: SiteStore, study: str, round_: int) -> int | None:
    """The attempt of round `round_` of `study` whose unmasking shares this site sent, if any."""
    attempt = (store.load_record(_REVEALED, study) or {}).get(str(round_))
    return int(attempt) if attempt is not None else None
