# syntax=docker/dockerfile:1
# The kvpool sidecar image: `kvpool sidecar --config FILE`, the command the operator's
# DaemonSet runs (see operator/kvpool_operator/manifests.py). Non-root, no build tools.
#   docker build -f docker/sidecar.Dockerfile -t ghcr.io/kvpool/kvpool:0.1.0 .
# GPU tier: the NVIDIA container runtime injects libnvidia-ml (pynvml) and the driver;
# torch is not in this image (the GPU tier is optional; add it in a derived image).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# --- build: the project and its `sidecar` extra into a virtualenv ----------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvpool
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client/ client/
COPY sidecar/ sidecar/
COPY operator/ operator/
COPY bench/ bench/
RUN /opt/kvpool/bin/pip install '.[sidecar]' \
 && /opt/kvpool/bin/kvpool --help >/dev/null

# --- runtime -----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvpool" \
      org.opencontainers.image.description="kvpool sidecar: a node's tiered KV-cache store" \
      org.opencontainers.image.source="https://github.com/kvpool/kvpool" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvpool \
 && useradd --system --uid 10001 --gid kvpool --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvpool
COPY --from=build /opt/kvpool /opt/kvpool
ENV PATH=/opt/kvpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# 9467: peer transfers (peer.port, spec.transport.port); 9466: /healthz, /metrics, /stats.
EXPOSE 9467 9466
ENTRYPOINT ["kvpool"]
CMD ["sidecar", "--config", "/etc/kvpool/config/sidecar.yaml"]
