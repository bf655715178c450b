# syntax=docker/dockerfile:1
# The Tandem operator: `tandem operator` (kopf), no torch, no GPU. Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/tandem-serving/tandem-operator:0.1.0 .
# See docs/helm.md ("Images"). hack/images.py builds it on a local Debian 12 base without a
# registry: PYTHON_IMAGE is that base, PIP_INSTALL_ARGS points pip at a mounted wheel folder.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PIP_INSTALL_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
# Dependencies first, from pyproject.toml and the lock alone: a source change reuses this layer.
COPY pyproject.toml requirements-lock.txt ./
RUN python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
        print("\n".join(p["dependencies"] + p["optional-dependencies"]["operator"]))' > /tmp/requirements.txt \
    && /opt/venv/bin/pip install $PIP_INSTALL_ARGS -c requirements-lock.txt -r /tmp/requirements.txt
COPY README.md ./
COPY operator ./operator
COPY worker ./worker
RUN /opt/venv/bin/pip install $PIP_INSTALL_ARGS --no-deps .

FROM ${PYTHON_IMAGE}
# The same unprivileged uid the chart's securityContext asks for, with a passwd entry: kopf names
# itself after getpass.getuser(), which raises for a uid the system does not know.
RUN useradd --uid 65532 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tandem
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["tandem"]
CMD ["operator"]
