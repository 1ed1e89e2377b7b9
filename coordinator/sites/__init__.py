"""Sites and who may call: enrolment and tokens (access.py), authentication (security.py), approvals (approvals.py).

It may import the coordinator's base (models, db, errors, audit) and shared/; rounds, studies and
the API stand on it, never the reverse.
"""
