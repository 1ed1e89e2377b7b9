"""Where a study's terms are applied: the top floor of shared/, used by both services.

- checks: every rule that needs more than one field (registry, DP, secure aggregation): `check_study`;
- rules: what a study exchanges, its round 0, its server update and each round's participants;
- description: what a site's operator approves and its digest;
- round_terms, server_round: one round as the terms make it, at a site and at the coordinator;
- dp, accounting: client-level differential privacy and its epsilon;
- secure_setup, secagg, vectors: secure aggregation's parameters for a study and its masked vectors.
"""
