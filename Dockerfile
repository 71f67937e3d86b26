# spotguard daemon image: `spotguard run` as a non-root user, with the S3 and GCS backends.
# No torch: the trainer hook lives in the trainer's own image (pip install "spotguard[torch]").
# Running it next to a trainer container (host network, shared socket volume): docs/deploy.md.

# Pinned tag; pin the digest too (python:3.11.11-slim-bookworm@sha256:...) for fully
# reproducible builds in your registry mirror.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY spotguard/ spotguard/
# Wheels for spotguard *and* its dependencies, so the runtime stage installs offline from
# exactly what was resolved here and needs no compilers.
RUN pip wheel --wheel-dir /wheels ".[aws,gcp]"

FROM ${PYTHON_IMAGE} AS runtime
# The gid must match the group the trainer (container) runs with, so it can use the 0660 socket.
ARG SPOTGUARD_UID=10001
ARG SPOTGUARD_GID=10001
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid "${SPOTGUARD_GID}" spotguard \
    && useradd --system --uid "${SPOTGUARD_UID}" --gid spotguard --no-create-home \
        --home-dir /var/lib/spotguard --shell /usr/sbin/nologin spotguard \
    && install -d -o spotguard -g spotguard -m 0750 /run/spotguard \
    && install -d -o spotguard -g spotguard -m 0770 /var/lib/spotguard \
        /var/lib/spotguard/checkpoints /var/lib/spotguard/state
# spotguard is unpinned here on purpose: --no-index means the only candidate is the wheel
# built from this repository in the builder stage.
# hadolint ignore=DL3013
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "spotguard[aws,gcp]"
USER ${SPOTGUARD_UID}:${SPOTGUARD_GID}
WORKDIR /var/lib/spotguard
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["spotguard", "status", "--json"]
ENTRYPOINT ["spotguard", "run"]
