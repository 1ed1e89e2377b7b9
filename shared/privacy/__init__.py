"""Secure aggregation (SecAgg+) and discrete-noise primitives, as a pure library: plain data in and out, no torch.

Nothing here sends a message or reads a study's terms: the client and server states produce and consume
plain data that the coordinator relays. Modules, lowest first: errors, shamir, prg, quantize, keys, graph,
masking, messages, client, server; discrete (exact discrete Gaussian noise, conditional rounding) for
differential privacy. How a study applies them (its secure setup, masked vectors, DP and epsilon) is
shared/study/. Import what you need from its module: the package itself imports nothing.
"""
