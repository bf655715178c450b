# syntax=docker/dockerfile:1
# Tandem workers and router (`tandem worker|router|serve`) on CUDA, with rdma-core 59 and the
# matching pyverbs 59 for the RDMA KV transport. Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t ghcr.io/tandem-serving/tandem:0.1.0 .
# See docs/helm.md ("Images"). The image is large (torch with its CUDA libraries).
#
# The build arguments also make the CPU test image of the local real node without a registry
# (hack/images.py): BASE_IMAGE a Debian 12 made with mmdebstrap, PYTHON_FROM=system (its Python
# 3.11), RDMA=0, UV_IMAGE an image holding uv from PyPI, and UV_INSTALL_ARGS pointing uv at a
# wheel folder mounted into the build, so that torch is not downloaded again.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.9.5

FROM ${UV_IMAGE} AS uv

# rdma-core and pyverbs are compiled here, so that the runtime image carries no compiler.
FROM ${BASE_IMAGE} AS rdma
ARG RDMA=1
ARG PYTHON_VERSION=3.11
ARG PYTHON_FROM=uv
ARG PYVERBS_VERSION=59.0
ARG UV_INSTALL_ARGS=""
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_LINK_MODE=copy UV_NO_CACHE=1
# pyverbs 59 needs libibverbs 59 at run time (symbol version IBVERBS_PRIVATE_59), newer than any
# distribution package here. Its sdist bundles rdma-core's source: build the libraries and
# providers from it into /opt/rdma-core, then a pyverbs wheel (Cython must stay below 3.1).
RUN mkdir -p /opt/rdma-core /opt/rdma-wheels && if [ "$RDMA" = 1 ]; then \
        apt-get update && apt-get install -y --no-install-recommends \
            build-essential cmake ninja-build pkg-config ca-certificates curl \
            libnl-3-dev libnl-route-3-dev libudev-dev \
        && rm -rf /var/lib/apt/lists/* \
        && curl -fsSL "https://files.pythonhosted.org/packages/source/p/pyverbs/pyverbs-${PYVERBS_VERSION}.tar.gz" \
            | tar -xz -C /tmp \
        && cmake -S /tmp/pyverbs-${PYVERBS_VERSION}/rdma-core -B /tmp/rdma-build -GNinja \
            -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/opt/rdma-core \
            -DNO_MAN_PAGES=1 -DNO_PYVERBS=1 \
        && ninja -C /tmp/rdma-build install \
        && if [ "$PYTHON_FROM" = system ]; then uv venv --python /usr/bin/python3 /tmp/build-venv; \
           else uv python install ${PYTHON_VERSION} && uv venv --python ${PYTHON_VERSION} /tmp/build-venv; fi \
        && VIRTUAL_ENV=/tmp/build-venv uv pip install $UV_INSTALL_ARGS \
            "cython>=3.0.12,<3.1" "scikit-build-core>=0.10" setuptools-scm \
        && VIRTUAL_ENV=/tmp/build-venv uv build --wheel --no-build-isolation --python /tmp/build-venv/bin/python \
            --out-dir /opt/rdma-wheels /tmp/pyverbs-${PYVERBS_VERSION}; \
    fi

FROM ${BASE_IMAGE}
ARG RDMA=1
ARG PYTHON_VERSION=3.11
ARG PYTHON_FROM=uv
ARG UV_INSTALL_ARGS=""
RUN if [ "$RDMA" = 1 ]; then \
        apt-get update && apt-get install -y --no-install-recommends libnl-3-200 libnl-route-3-200 libudev1 \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# Runs as an unprivileged user. RDMA memory registration pins pages: over the rdma transport a
# pod needs CAP_IPC_LOCK, which Kubernetes gives a non-root process only in its bounding set, so
# such pods run as root (runAsUser: 0) or on nodes whose runtime raises RLIMIT_MEMLOCK.
RUN useradd --uid 65532 --user-group --create-home --shell /usr/sbin/nologin tandem
COPY --from=uv /uv /usr/local/bin/uv
COPY --from=rdma /opt/rdma-core /opt/rdma-core
# Tandem needs Python >= 3.11, which Ubuntu 24.04 does not ship: uv installs a standalone build
# into /opt/python. PYTHON_FROM=system uses the base image's python3 instead (Debian 12: 3.11).
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_LINK_MODE=copy UV_NO_CACHE=1 VIRTUAL_ENV=/opt/venv
RUN if [ "$PYTHON_FROM" = system ]; then uv venv --python /usr/bin/python3 /opt/venv; \
    else uv python install ${PYTHON_VERSION} && uv venv --python ${PYTHON_VERSION} /opt/venv; fi
ENV PATH=/opt/venv/bin:$PATH \
    LD_LIBRARY_PATH=/opt/rdma-core/lib \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

# Dependencies first, from pyproject.toml and the lock alone (gigabytes: torch with CUDA): a
# source change rebuilds only the small layers below this one.
WORKDIR /src
COPY pyproject.toml requirements-lock.txt ./
RUN uv pip install $UV_INSTALL_ARGS -c requirements-lock.txt -r pyproject.toml --extra worker
COPY --from=rdma /opt/rdma-wheels /opt/rdma-wheels
RUN if [ "$RDMA" = 1 ]; then uv pip install --no-deps /opt/rdma-wheels/*.whl; fi
COPY README.md ./
COPY operator ./operator
COPY worker ./worker
RUN uv pip install $UV_INSTALL_ARGS --no-deps . && rm -rf /src/build

USER 65532:65532
WORKDIR /home/tandem
EXPOSE 8000 5555
ENTRYPOINT ["tandem"]
CMD ["worker", "--help"]
