# One image, both entry points: `gpuslice partitioner` and `gpuslice agent` (console script
# `gpuslice` is the entrypoint; the Helm chart passes the subcommand).
#
#   docker build -t <registry>/gpuslice:0.1.0 .
#
# The image runs as the unprivileged user 65532. The partitioner keeps it (non-root, read-only
# root filesystem, no capabilities). The node agent must run as root, which its pod spec sets
# (runAsUser: 0, CAP_SYS_ADMIN): the kubelet's device-plugin and pod-resources sockets are
# root-only, and creating or destroying MIG instances through NVML needs root or CAP_SYS_ADMIN.
# NVML (libnvidia-ml) and the MPS binaries are not in the image: the NVIDIA container runtime
# injects the host driver's copies into the agent's container.
#
# Reproducible builds: the base image is pinned by digest, and every Python package comes from
# requirements/image.lock (one version each, sha256 hashes, wheels only, for CPython 3.12 on
# linux/amd64 and linux/arm64); the package itself is installed with --no-deps and without
# build isolation, so nothing unpinned is downloaded. The image carries the runtime
# dependencies only: the `sim` extra (matplotlib, for `gpuslice simulate` and `sweep`) is left
# out, and those two commands say so. After changing dependencies in pyproject.toml, run
# `bash requirements/lock.sh` (requirements/README.md).
#
# Base image: python 3.12 slim on Debian bookworm, the digest of its multi-arch index (amd64 and
# arm64). Refresh it with `docker buildx imagetools inspect python:3.12-slim-bookworm` (the
# "Digest:" line; or `crane digest python:3.12-slim-bookworm`) and put tag and digest below, or
# override it per build: docker build --build-arg PYTHON_IMAGE=<image>@sha256:<digest> .
ARG PYTHON_IMAGE=python:3.12.3-slim-bookworm@sha256:541d45d3d675fb8197f534525a671e2f8d66c882b89491f9dda271f4f94dcd06

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The locked dependencies first: this layer is rebuilt only when the lock changes.
COPY requirements/image.lock ./requirements/image.lock
RUN python -m venv /opt/gpuslice \
 && /opt/gpuslice/bin/pip install --require-hashes --only-binary=:all: --no-deps \
      -r requirements/image.lock
# Only what the package build reads (.dockerignore keeps the context to the same list).
COPY pyproject.toml README.md ./
COPY planner ./planner
COPY contract ./contract
COPY partitioner ./partitioner
COPY node_agent ./node_agent
COPY simulations ./simulations
COPY gpuslice ./gpuslice
# A non-editable install into a venv at the same path the runtime stage uses; byte-compiled
# here because the runtime root filesystem is read-only. The build backend (setuptools, wheel:
# locked too) is removed afterwards; `pip check` fails the build if the lock misses a
# dependency of any installed package.
RUN /opt/gpuslice/bin/pip install --no-deps --no-build-isolation . \
 && /opt/gpuslice/bin/pip uninstall --yes setuptools wheel \
 && /opt/gpuslice/bin/pip check \
 && /opt/gpuslice/bin/gpuslice --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpuslice" \
      org.opencontainers.image.description="On-demand NVIDIA MIG/MPS partitioning for Kubernetes: partitioner and node agent" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/gpuslice/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
COPY --from=build /opt/gpuslice /opt/gpuslice
USER 65532:65532
ENTRYPOINT ["gpuslice"]
CMD ["--help"]
