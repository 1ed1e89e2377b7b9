"""The researcher's and admin's client of a coordinator: typed HTTP calls (torch-free) and the `cardiofl` commands.

`CardioflClient` speaks the coordinator's REST API and returns the models of shared/wire/api.py;
the `cardiofl study|token|site enroll ...` commands live in `cardiofl.client.cli` (imported on demand).
"""

from cardiofl.client.http import ApiError, CardioflClient, tls_from_env

__all__ = ["ApiError", "CardioflClient", "tls_from_env"]
