# syntax=docker/dockerfile:1
# The Tandem operator: `tandem operator` (kopf), no torch, no GPU. Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/tandem-serving/tandem-operator:0.1.0 .
# See docs/helm.md ("Images").
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY worker ./worker
RUN python -m venv /opt/venv && /opt/venv/bin/pip install ".[operator]"

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
# The same unprivileged uid the chart's securityContext asks for.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["tandem"]
CMD ["operator"]
