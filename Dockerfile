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
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the package build reads (.dockerignore keeps the context to the same list).
COPY pyproject.toml README.md ./
COPY planner ./planner
COPY contract ./contract
COPY partitioner ./partitioner
COPY node_agent ./node_agent
COPY simulations ./simulations
COPY gpuslice ./gpuslice
# A non-editable install into a venv at the same path the runtime stage uses; byte-compiled
# here because the runtime root filesystem is read-only.
RUN python -m venv /opt/gpuslice \
 && /opt/gpuslice/bin/pip install . \
 && /opt/gpuslice/bin/gpuslice --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpuslice" \
      org.opencontainers.image.description="On-demand NVIDIA MIG/MPS partitioning for Kubernetes: partitioner and node agent" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/gpuslice/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
COPY --from=build /opt/gpuslice /opt/gpuslice
USER 65532:65532
ENTRYPOINT ["gpuslice"]
CMD ["--help"]
