"""A buffered asynchronous study's settings (FedBuff, Nguyen et al. 2022): the terms' `[buffered]` table.

In a buffered study no site waits for the slowest: a site trains from the latest version of theta^g
it is given and uploads its change with that version; once `buffer_size` updates have arrived, the
next version is released from them (shared/algorithms/buffered.py), each update weighed by the study's
weighting within its buffer times s(τ) of the τ versions it lags behind, its change taken against
the version it trained from. An update more than `max_staleness` versions behind is refused. A site
has at most one update in a buffer; it is given the next version once that buffer is released. The
terms' `rounds` count releases. Checked against the rest of the terms in shared/study/checks.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.terms.study_kinds import Terms

__all__ = ["BufferedSpec", "Staleness"]

# s(τ): 1/sqrt(1 + τ) as in FedBuff, 1/(1 + τ), or 1 (every update alike)
Staleness = Literal["inverse_sqrt", "inverse", "constant"]


class BufferedSpec(Terms):
    """M, the staleness allowed and its weighting, and the server's learning rate."""

    buffer_size: int = Field(ge=1, le=10_000)  # M: the updates that release the next version
    max_staleness: int = Field(4, ge=0, le=100_000)  # an update more versions behind is refused
    staleness: Staleness = "inverse_sqrt"
    server_lr: float = Field(1.0, gt=0, le=100)  # eta: theta^g_v + eta * the buffer's weighted change
