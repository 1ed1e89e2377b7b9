"""Flower echo app: the same no-training round as cardiofl's echo agents, for a like-for-like comparison."""
