"""What each federated algorithm declares to both sides: parameters, exchanged names, server update, participation.

The coordinator and the site agent read the same declarations (through shared/study/rules.py), so the
names a study exchanges are derived in one place. Client-side training lives in site_agent/algorithms.
"""
