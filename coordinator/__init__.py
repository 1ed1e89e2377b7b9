"""The cardiofl coordinator: runs federated studies round by round and stores every global model.

Its rooms, each importing only those below it (checked by `lint-imports`, pyproject.toml):

    cli.py, main.py          the commands (cli_tls.py, tls_serve.py beside them) and the app
    api/                     HTTP: routes, auth dependencies, errors, metrics, the dashboard
    studies/                 a study's lifecycle and the read models shown of it
    rounds/                  the round lifecycle and its plain and secure workflows, uploads, tasks
    sites/ | storage/        enrolment, tokens, approvals | blobs, stored updates, retention
    (base)                   models.py, db.py, errors.py, audit.py, config.py, migrate.py
    pki/                     the certificate authority, apart: only the TLS commands use it
"""
