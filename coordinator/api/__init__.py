"""The coordinator's HTTP API under /api/v1."""
