# cardiofl site agent: trains on the hospital's GPU (CPU fallback) and talks to the coordinator outbound only.
# Build from the repository root:  docker build -f deploy/site-agent.Dockerfile -t cardiofl/site-agent .
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/cardiofl \
    PATH=/opt/cardiofl/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/cardiofl

# The PyPI torch wheel for Linux x86-64 bundles its CUDA libraries; the agent uses the GPU when
# the container runs with the NVIDIA runtime (`--gpus all`) and falls back to the CPU otherwise.
RUN pip install "torch==2.13.0"
COPY pyproject.toml README.md /src/
COPY cardiofl /src/cardiofl
COPY shared /src/shared
COPY coordinator /src/coordinator
COPY site_agent /src/site_agent
COPY migrations /src/migrations
RUN pip install /src && rm -rf /src

# Non-root user; the data volume is mounted read-only, the store and cache volumes are the
# agent's only writable places.
RUN useradd --system --uid 10001 --home-dir /var/lib/cardiofl --create-home cardiofl \
 && mkdir -p /var/lib/cardiofl/store /var/lib/cardiofl/cache /data \
 && chown -R cardiofl:cardiofl /var/lib/cardiofl
USER cardiofl
WORKDIR /var/lib/cardiofl

ENV CARDIOFL_SITE_STORE_DIR=/var/lib/cardiofl/store \
    CARDIOFL_SITE_CACHE_DIR=/var/lib/cardiofl/cache \
    CARDIOFL_SITE_HEARTBEAT_FILE=/var/lib/cardiofl/heartbeat \
    CARDIOFL_SITE_PROGRESS_BAR=false

VOLUME ["/var/lib/cardiofl"]

# Healthy while the agent polls: the heartbeat is written after every poll.
HEALTHCHECK --interval=60s --timeout=10s --start-period=120s --retries=3 \
    CMD ["cardiofl", "site", "health", "--max-age", "600"]

ENTRYPOINT ["tini", "--"]
CMD ["cardiofl", "site", "run"]
