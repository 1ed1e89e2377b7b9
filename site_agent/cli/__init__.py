"""The site's commands, `cardiofl site ...`: one module a group.

app (run, check, status and the command tree), approvals, data, model (evaluate, export, predict), tls.
"""
