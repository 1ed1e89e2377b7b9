"""Secure aggregation (SecAgg+) and client-level differential privacy (DP-FedAvg), as a pure library.

Nothing here sends a message: the client and server states produce and consume plain data that
the coordinator relays. Modules, lowest first: errors, shamir, prg, quantize, vectors, keys,
graph, masking, messages, client, server; discrete (exact discrete Gaussian noise, conditional
rounding) for differential privacy; study_secagg and study_dp apply them to a study, accounting
computes a DP study's epsilon. Import what you need from its module: the package itself
imports nothing, so the torch-free modules (keys, shamir, graph, messages ...) stay torch-free.
"""
