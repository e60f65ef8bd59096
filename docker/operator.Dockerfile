# syntax=docker/dockerfile:1
# The kvpool operator image: `python -m kvpool_operator` (kopf), non-root, no build tools.
# It also holds the CSI node plugin (`python -m kvpool_csi`, the chart's csi.enabled).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvpool/kvpool-operator:0.1.0 .
# The chart (charts/kvpool) runs it with a read-only root filesystem as uid 10001.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# --- build: the project and its `operator` extra into a virtualenv ---------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvpool
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client/ client/
COPY sidecar/ sidecar/
COPY operator/ operator/
COPY bench/ bench/
RUN /opt/kvpool/bin/pip install '.[operator,csi]' \
 && /opt/kvpool/bin/python -c 'import kvpool_operator.handlers, kvpool_csi.service'

# --- runtime -----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvpool-operator" \
      org.opencontainers.image.description="Kubernetes operator for kvpool KV-cache pools" \
      org.opencontainers.image.source="https://github.com/kvpool/kvpool" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvpool \
 && useradd --system --uid 10001 --gid kvpool --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvpool
COPY --from=build /opt/kvpool /opt/kvpool
ENV PATH=/opt/kvpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVPOOL_OPERATOR_LIVENESS=http://0.0.0.0:8080/healthz
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["python", "-m", "kvpool_operator"]
