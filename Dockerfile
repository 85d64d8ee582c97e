# trionserve: a Triton-compatible inference server (CPU image).
#
#   docker build -t trionserve .
#   docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#     -v "$PWD/examples/model_repository:/models:ro" trionserve
#
# Extra arguments replace the default command, e.g.
#   docker run ... trionserve --model-repository=s3://bucket/models --model-control-mode=poll
# See docs/deploy.md.

ARG PYTHON_VERSION=3.12

# -- build: a wheel of this checkout -------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trionserve ./trionserve
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- runtime -------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim
# Optional dependency groups of pyproject.toml to install (comma-separated):
# s3, gcs, azure for object-storage repositories, torch for TorchScript models.
ARG EXTRAS=s3,gcs,azure
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 1000 trionserve \
    && useradd --system --uid 1000 --gid trionserve --create-home trionserve \
    && mkdir /models \
    && chown trionserve:trionserve /models

COPY --from=build /wheels /wheels
# The wheel is this checkout, built above; its dependencies' versions come from
# pyproject.toml.
# hadolint ignore=DL3013
RUN wheel="$(find /wheels -name 'trionserve-*.whl')" \
    && pip install --no-cache-dir "${wheel}[${EXTRAS}]" \
    && rm -rf /wheels \
    && mkdir -p /opt/tritonserver/bin \
    && ln -s "$(command -v tritonserver)" /opt/tritonserver/bin/tritonserver

USER 1000:1000
WORKDIR /home/trionserve
# HTTP/REST, gRPC, Prometheus metrics: Triton's ports.
EXPOSE 8000 8001 8002
# Kubernetes uses its own probes (deploy/kubernetes); this one serves Docker and Compose.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2)"]
# SIGTERM drains: readiness false at once, in-flight requests finish (--exit-timeout-secs).
STOPSIGNAL SIGTERM
# Manifests written for Triton run unchanged: its image runs its arguments as a
# command (args: ["tritonserver", "--model-store=..."], as its Helm charts pass
# them), and `tritonserver` (also /opt/tritonserver/bin/tritonserver) is this
# server; arguments that start with "-" are trionserve's own.
ENTRYPOINT ["/bin/sh", "-c", "case \"$1\" in -*|'') exec trionserve \"$@\" ;; *) exec \"$@\" ;; esac", "entrypoint"]
CMD ["--model-repository=/models"]
