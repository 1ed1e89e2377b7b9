#!/bin/sh
# The cardiofl/postgres image's entrypoint (deploy/postgres.Dockerfile), run as the postgres user.
#
# On first start, when $PGDATA (the data volume) holds no cluster yet: initdb (UTF-8, C.UTF-8,
# SCRAM-SHA-256 for every TCP connection, peer for the local socket), then, on a server that listens
# on no TCP port, the role $POSTGRES_USER (LOGIN, not a superuser) with the password read from
# $POSTGRES_PASSWORD_FILE, and the database $POSTGRES_DB it owns. The superuser `postgres` has no
# password: it logs in only through the socket inside the container (`docker compose exec postgres psql`).
# Every start then runs the server in the foreground, listening on all of the container's addresses
# (the compose network) and on a socket in $PGHOST (/tmp), with any arguments given (`-c name=value`) added.
#
# The password is read once, at initialisation: to change it later, run `\password cardiofl` in
# `docker compose exec postgres psql`, then update the secret file and restart the coordinator.
set -eu

: "${PGDATA:=/var/lib/postgresql/data}"
: "${PGHOST:=/tmp}"  # the socket's folder: the tmpfs on a read-only root file system
export PGHOST
: "${POSTGRES_USER:=cardiofl}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
: "${POSTGRES_PASSWORD_FILE:=/run/secrets/postgres_password}"

say() { echo "postgres-entrypoint: $*" >&2; }

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ ! -r "$POSTGRES_PASSWORD_FILE" ]; then
        say "cannot read the password file $POSTGRES_PASSWORD_FILE (uid $(id -u) must be able to read it)"
        exit 1
    fi
    # As the coordinator's `$(cat file)` reads it: the file's text without its trailing newlines.
    CARDIOFL_INIT_PASSWORD="$(cat "$POSTGRES_PASSWORD_FILE")"
    if [ -z "$CARDIOFL_INIT_PASSWORD" ]; then
        say "the password file $POSTGRES_PASSWORD_FILE is empty"
        exit 1
    fi
    export CARDIOFL_INIT_PASSWORD

    say "initialising a new cluster in $PGDATA"
    initdb --pgdata="$PGDATA" --username=postgres --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=peer --auth-host=scram-sha-256 >/dev/null
    # initdb allows TCP from the loopback addresses only; the coordinator comes over the compose network.
    printf '\n# cardiofl: any address, with a SCRAM-SHA-256 password\nhost all all all scram-sha-256\n' \
        >>"$PGDATA/pg_hba.conf"

    # A server on the socket alone (nothing can connect from outside, and the health check, which
    # asks 127.0.0.1, stays unhealthy), that never logs a statement, not even a failed one: the
    # password is in one.
    pg_ctl --pgdata="$PGDATA" --wait --silent --options="-c listen_addresses='' -c unix_socket_directories=$PGHOST \
        -c log_min_error_statement=panic -c log_statement=none" start
    psql --no-psqlrc --quiet --set=ON_ERROR_STOP=1 --dbname=postgres \
        --set=role="$POSTGRES_USER" --set=db="$POSTGRES_DB" <<'SQL'
\getenv password CARDIOFL_INIT_PASSWORD
SET password_encryption = 'scram-sha-256';
CREATE ROLE :"role" LOGIN PASSWORD :'password';
CREATE DATABASE :"db" OWNER :"role";
SQL
    unset CARDIOFL_INIT_PASSWORD
    pg_ctl --pgdata="$PGDATA" --wait --silent --mode=fast stop
    say "created role $POSTGRES_USER and database $POSTGRES_DB"
fi

exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories="$PGHOST" "$@"
