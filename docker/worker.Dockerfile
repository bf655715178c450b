# syntax=docker/dockerfile:1
# Tandem workers and router (`tandem worker|router|serve`) on CUDA, with rdma-core 59 and the
# matching pyverbs 59 for the RDMA KV transport. Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t ghcr.io/tandem-serving/tandem:0.1.0 .
# See docs/helm.md ("Images"). The image is large (torch with its CUDA libraries).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.9.5

FROM ${UV_IMAGE} AS uv

FROM ${CUDA_IMAGE} AS build
ARG PYTHON_VERSION=3.11
ARG PYVERBS_VERSION=59.0
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake ninja-build pkg-config ca-certificates curl \
        libnl-3-dev libnl-route-3-dev libudev-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=uv /uv /usr/local/bin/uv
# Tandem needs Python 3.11, which Ubuntu 24.04 does not ship: uv installs a standalone build.
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_LINK_MODE=copy UV_NO_CACHE=1 VIRTUAL_ENV=/opt/venv
RUN uv python install ${PYTHON_VERSION} && uv venv --python ${PYTHON_VERSION} /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# pyverbs 59 needs libibverbs 59 at run time (symbol version IBVERBS_PRIVATE_59), newer than any
# distribution package here. Its sdist bundles rdma-core's source: build the libraries and
# providers from it into /opt/rdma-core, then pyverbs itself (Cython must stay below 3.1).
RUN curl -fsSL "https://files.pythonhosted.org/packages/source/p/pyverbs/pyverbs-${PYVERBS_VERSION}.tar.gz" \
        | tar -xz -C /tmp \
    && cmake -S /tmp/pyverbs-${PYVERBS_VERSION}/rdma-core -B /tmp/rdma-build -GNinja \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/opt/rdma-core \
        -DNO_MAN_PAGES=1 -DNO_PYVERBS=1 \
    && ninja -C /tmp/rdma-build install \
    && uv pip install "cython>=3.0.12,<3.1" "scikit-build-core>=0.10" setuptools-scm \
    && uv pip install --no-build-isolation /tmp/pyverbs-${PYVERBS_VERSION}

WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY worker ./worker
RUN uv pip install ".[worker]"

FROM ${CUDA_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends libnl-3-200 libnl-route-3-200 libudev1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/rdma-core /opt/rdma-core
ENV PATH=/opt/venv/bin:$PATH \
    LD_LIBRARY_PATH=/opt/rdma-core/lib \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Runs as root: registering RDMA memory pins pages, which needs CAP_IPC_LOCK (the operator adds
# it to worker pods), and Kubernetes grants added capabilities only to root processes.
EXPOSE 8000 5555
ENTRYPOINT ["tandem"]
CMD ["worker", "--help"]
