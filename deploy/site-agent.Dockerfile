# cardiofl site agent: trains on the hospital's GPU (CPU fallback) and talks to the coordinator outbound only.
# Build from the repository root, without the network (deploy/build-images.sh does all three steps):
#   deploy/make-base-image.sh && deploy/make-wheelhouse.sh
#   docker build -f deploy/site-agent.Dockerfile -t cardiofl/site-agent .
# The CUDA variant is the same file on the same Debian base with another wheelhouse: PyPI's torch and
# the nvidia-* wheels it depends on are the image's only CUDA runtime; the host gives the driver
# through the NVIDIA container toolkit (`docker run --gpus all`):
#   deploy/make-wheelhouse.sh cuda
#   docker build -f deploy/site-agent.Dockerfile --build-arg WHEELHOUSE=.wheelhouse/cuda -t cardiofl/site-agent:cuda .
# The first two stages are the same as the coordinator's: both images share their layers.
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

# Non-root user; the data volume is mounted read-only, the store and cache volumes are the
# agent's only writable places (it runs with a read-only root file system and a tmpfs on /tmp).
RUN mkdir -p /var/lib/cardiofl/store /var/lib/cardiofl/cache /data \
 && chown -R cardiofl:cardiofl /var/lib/cardiofl
USER cardiofl
WORKDIR /var/lib/cardiofl

ENV CARDIOFL_SITE_STORE_DIR=/var/lib/cardiofl/store \
    CARDIOFL_SITE_CACHE_DIR=/var/lib/cardiofl/cache \
    CARDIOFL_SITE_HEARTBEAT_FILE=/var/lib/cardiofl/heartbeat \
    CARDIOFL_SITE_PROGRESS_BAR=false \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

VOLUME ["/var/lib/cardiofl"]

# Healthy while the agent polls: the heartbeat file is touched after every poll.
HEALTHCHECK --interval=60s --timeout=10s --start-period=120s --retries=3 \
    CMD ["cardiofl", "site", "health"]

ENTRYPOINT ["tini", "--"]
CMD ["cardiofl", "site", "run"]
