# cardiofl coordinator: REST API, round engine and model store (PostgreSQL in production).
# Build from the repository root:  docker build -f deploy/coordinator.Dockerfile -t cardiofl/coordinator .
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

# The coordinator only averages tensors: the CPU build of torch is enough.
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md /src/
COPY cardiofl /src/cardiofl
COPY shared /src/shared
COPY coordinator /src/coordinator
COPY site_agent /src/site_agent
COPY migrations /src/migrations
RUN pip install /src && rm -rf /src

RUN useradd --system --uid 10001 --home-dir /var/lib/cardiofl --create-home cardiofl
USER cardiofl
WORKDIR /var/lib/cardiofl
# The blob store's mount point, owned by the service user so that a fresh volume is too.
RUN mkdir -p /var/lib/cardiofl/blobs

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/api/v1/health', timeout=4)"]

# Migrations run before the workers start (CARDIOFL_MIGRATE_ON_START covers single-process runs).
CMD ["sh", "-c", "cardiofl coordinator migrate && exec cardiofl coordinator serve --host 0.0.0.0 --port 8000 --workers ${CARDIOFL_WORKERS:-2}"]
