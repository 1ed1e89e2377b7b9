# cardiofl/postgres: Debian's PostgreSQL server on the images' base, for deploy/compose.coordinator.yaml.
#
# No network inside the build, as for the other images: deploy/build-images.sh first downloads, on
# the build host, the Debian packages that `apt-get install postgresql` would add to BASE_IMAGE
# (resolved against the base image's own installed packages and package sources, at their current
# versions) into deploy/.debs; this build installs those files alone. The build context is deploy/
# (deploy/.dockerignore: the packages and the entrypoint only):
#   deploy/build-images.sh      # all images; or, once deploy/.debs is filled:
#   docker build -f deploy/postgres.Dockerfile --build-arg BASE_IMAGE=cardiofl/base:bookworm -t cardiofl/postgres deploy
# BASE_IMAGE: the Debian bookworm of make-base-image.sh (its PostgreSQL is 15). A data volume is
# tied to the major version: moving to another one takes pg_dump/pg_restore (or pg_upgrade).
#
# At run time (deploy/postgres-entrypoint.sh): as the postgres user (uid/gid 999), on a read-only
# root file system with a tmpfs on /tmp (the socket's folder, PGHOST), it initialises the data
# volume on first start (SCRAM-SHA-256, the password from POSTGRES_PASSWORD_FILE, by default the
# compose secret /run/secrets/postgres_password; POSTGRES_USER and POSTGRES_DB: cardiofl), then
# serves on port 5432 of every address the container has.
ARG BASE_IMAGE=cardiofl/base:bookworm
FROM ${BASE_IMAGE}

# A fixed uid and gid, so that secret files and volumes can be given to it on the host
# (the package's postinst keeps an existing postgres user).
RUN groupadd --system --gid 999 postgres \
 && useradd --system --uid 999 --gid 999 --home-dir /var/lib/postgresql --no-create-home --shell /bin/sh postgres

# The packages' scripts start no server and create no cluster here (the entrypoint makes one on the
# volume); ssl-cert's self-signed key, the same in every copy of the image, goes (the server does
# not use TLS: it listens on the private compose network only).
COPY .debs /tmp/debs
RUN printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d \
 && mkdir -p /etc/postgresql-common/createcluster.d \
 && echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.d/cardiofl.conf \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confold /tmp/debs/*.deb >/dev/null \
 && rm -rf /tmp/debs /usr/sbin/policy-rc.d /var/lib/postgresql/* /etc/postgresql/*/main \
        /etc/ssl/private/ssl-cert-snakeoil.key /etc/ssl/certs/ssl-cert-snakeoil.pem \
        /var/cache/apt/*.bin /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* /var/log/apt/* /var/log/*.log \
 && ln -s "$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)" /usr/lib/postgresql/bin \
 && /usr/lib/postgresql/bin/postgres --version

# PGHOST: the socket's folder, for the server and for psql (`docker compose exec postgres psql`).
ENV PATH=/usr/lib/postgresql/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data \
    PGHOST=/tmp
# The data volume's mount point, owned by the server's user so that a fresh volume is too.
RUN mkdir -p "$PGDATA" && chown postgres:postgres /var/lib/postgresql "$PGDATA" && chmod 700 "$PGDATA"
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint

USER postgres
WORKDIR /var/lib/postgresql
VOLUME ["/var/lib/postgresql/data"]
EXPOSE 5432

# Ready once the real server accepts TCP connections (the first start's own server listens on the
# socket only). pg_isready sends no password.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["pg_isready", "--host=127.0.0.1", "--port=5432", "--quiet"]

# SIGINT: PostgreSQL's fast shutdown (SIGTERM would wait for every client to disconnect).
STOPSIGNAL SIGINT
ENTRYPOINT ["tini", "--", "postgres-entrypoint"]
CMD []
