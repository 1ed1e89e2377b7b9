"""Rounds: one lifecycle (open, accept, close, aggregate, finish, retry) around a workflow per kind of round.

- opening.py opens a round; updates.py accepts an update; closing.py closes, aggregates under a
  lease, finishes (theta^g_t, the next round) or fails and retries;
- workflow.py is the RoundWorkflow protocol; plain.py and secure.py (with secure_messages.py)
  implement it; dispatch.py picks one from a study's terms, the one place that asks which;
- tasks.py answers a site's poll, declines.py records a declined task, upload_schema.py derives
  what an update holds;
- job_studies.py settles the studies that run no rounds (survey, evaluate): complete once every site
  reported, or at their deadline, which the same tick enforces.

It may import sites, storage, the base modules (models, db, errors, audit) and shared/; studies,
the API and the commands stand on it, never the reverse.
"""
