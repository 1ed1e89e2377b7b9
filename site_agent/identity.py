"""The site's long-term signing identity, kept in its encrypted store.

The identity (Ed25519, shared/privacy/signing.py) is made at the agent's first start and registered
with the coordinator (PUT /sites/me/signing-key); a secure study's terms name its public key, so a
coordinator that substitutes it changes the digest the site approves. What the site's secure rounds
used (the theta^g it trained from, the attempts it revealed in) is its ledger: site_agent/ledger.py.
"""

from __future__ import annotations

from shared.privacy.signing import SiteIdentity
from site_agent.store import SiteStore

__all__ = ["site_identity"]

_IDENTITY = "identity"


def site_identity(store: SiteStore) -> SiteIdentity:
    """The site's signing identity: the one in its store, or a new one, kept there at once."""
    record = store.load_record(_IDENTITY)
    if record is not None:
        return SiteIdentity.from_private_bytes(bytes.fromhex(record["private_key"]))
    identity = SiteIdentity.generate()
    store.save_record(_IDENTITY, {"private_key": identity.private_bytes().hex(), "public_key": identity.public_hex()})
    return identity
