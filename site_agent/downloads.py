"""A released model fetched by a site: the client's sha256-checked bytes, decoded only if they match the study's schema.

theta^g_t must hold exactly the study's global tensors (shared and server state), phi_0 exactly its
local ones, each of the schema's shape and dtype and finite; anything else raises the precise
PayloadError (shared/tensors/codec.py) before a tensor is used. The worker's rounds and the site's
jobs (site_agent/jobs.py) download through here.
"""

from __future__ import annotations

from shared.algorithms.exchange import Exchange
from shared.tensors.codec import TensorDict, validate
from site_agent.client import CoordinatorClient

__all__ = ["download_global", "download_initial_local"]


def download_global(client: CoordinatorClient, url: str, sha256: str, exchange: Exchange) -> TensorDict:
    """theta^g at `url`, of digest `sha256`, holding exactly the study's global schema."""
    tensors, _ = validate(client.download(url, sha256), exchange.global_schema())
    return tensors


def download_initial_local(client: CoordinatorClient, url: str, sha256: str, exchange: Exchange) -> TensorDict:
    """phi_0 at `url`, of digest `sha256`, holding exactly the study's local model tensors."""
    tensors, _ = validate(client.download(url, sha256), exchange.model_specs(exchange.partition.local))
    return tensors
