# cardiofl coordinator: REST API, round engine and model store (PostgreSQL in production).
# Build from the repository root, without the network (deploy/build-images.sh does all three steps):
#   deploy/make-base-image.sh && deploy/make-wheelhouse.sh
#   docker build -f deploy/coordinator.Dockerfile -t cardiofl/coordinator .
# BASE_IMAGE: a Debian bookworm with python3, python3-venv, ca-certificates and tini (make-base-image.sh).
# WHEELHOUSE: the wheels to install, with their requirements.txt (make-wheelhouse.sh); the
# coordinator only averages tensors, so torch's CPU build is enough.
# The first two stages are the same as the site agent's: both images share their layers.
ARG BASE_IMAGE=cardiofl/base:bookworm

FROM ${BASE_IMAGE} AS deps
ARG WHEELHOUSE=.wheelhouse/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels
COPY ${WHEELHOUSE} /wheels
RUN python3 -m venv /opt/cardiofl \
 && /opt/cardiofl/bin/pip install -q --upgrade pip \
 && /opt/cardiofl/bin/pip install -q -r /wheels/requirements.txt
# Never used at run time, and no compiler to use them with: C++ test programs and headers, test suites.
RUN cd /opt/cardiofl/lib/python3*/site-packages \
 && rm -rf torch/test torch/include torch/bin/*Test torch/bin/test_* torch/bin/protoc* \
 && find . -type d -name tests -prune -exec rm -rf {} + \
 && /opt/cardiofl/bin/python -c "import torch, numpy, scipy, pandas, wfdb, fastapi, sqlalchemy, psycopg, cryptography"

FROM deps AS wheel
COPY pyproject.toml README.md /src/
COPY cardiofl /src/cardiofl
COPY shared /src/shared
COPY coordinator /src/coordinator
COPY site_agent /src/site_agent
COPY migrations /src/migrations
RUN /opt/cardiofl/bin/pip wheel -q --no-deps --wheel-dir /dist /src

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/cardiofl \
    PATH=/opt/cardiofl/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN groupadd --system --gid 10001 cardiofl \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/cardiofl --create-home --shell /usr/sbin/nologin cardiofl
COPY --from=deps /opt/cardiofl /opt/cardiofl
COPY --from=wheel /dist /opt/cardiofl/dist
RUN pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check /opt/cardiofl/dist/*.whl

USER cardiofl
WORKDIR /var/lib/cardiofl
# The blob store's mount point, owned by the service user so that a fresh volume is too.
RUN mkdir -p /var/lib/cardiofl/blobs

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "coordinator.healthcheck"]

# Migrations run before the workers start (CARDIOFL_MIGRATE_ON_START covers single-process runs).
# Nothing is written outside the volumes: it runs with a read-only root file system (`--read-only`,
# a tmpfs on /tmp for upload spooling).
ENTRYPOINT ["tini", "--"]
CMD ["sh", "-c", "cardiofl coordinator migrate && exec cardiofl coordinator serve --host 0.0.0.0 --port ${CARDIOFL_PORT:-8000} --workers ${CARDIOFL_WORKERS:-2}"]
