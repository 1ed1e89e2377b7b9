"""The cardiofl coordinator: runs federated studies round by round and stores every global model.

Its rooms, each importing only those below it (checked by `lint-imports`, pyproject.toml):

    cli/                     the commands: app (`cardiofl coordinator ...`), tls (the CA's commands), admin_db
    main.py                  the app and its factories
    api/                     HTTP: routes, auth dependencies, errors, metrics, the dashboard
    studies/                 a study's lifecycle and the read models shown of it
    rounds/                  the round lifecycle and its plain and secure workflows, uploads, tasks
    sites/ | storage/ |      enrolment, tokens, approvals | blobs, update files, the download cache,
      signals/ | serving/    stored updates, retention | work: commits that may give a site work, and
                             waiters: the long-polls they wake | the server process, HTTPS (tls)
    (base)                   models.py, db.py, errors.py, audit.py, config.py, migrate.py, healthcheck.py
    pki/                     the certificate authority, apart: only the TLS commands use it
"""
