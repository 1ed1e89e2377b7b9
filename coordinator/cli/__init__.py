"""The coordinator's commands: app (`cardiofl coordinator ...`), tls (the CA's), admin_db (their database)."""
