# The observability profile's trace viewer: Arize Phoenix from PyPI, which takes OTLP (gRPC on
# 4317, HTTP on 6006/v1/traces) and shows every trace in its web UI (6006; one trace:
# /redirects/traces/<trace id>). Built FROM the base millstream's image uses: no image
# registry needed, only PyPI (or PIP_INDEX_URL's mirror).
#
#   docker build -f deploy/compose/traces.Dockerfile -t millstream-traces .   (context: repo root)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG PHOENIX_SPEC=arize-phoenix==20.26.1
ARG PIP_INDEX_URL
ARG PIP_RETRIES=0
ARG PIP_TIMEOUT=20
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_RETRIES=${PIP_RETRIES} \
    PIP_DEFAULT_TIMEOUT=${PIP_TIMEOUT}

# The CA bundle prepare.sh copied from the host's pip settings, as millstream's Dockerfile.
COPY deploy/compose/ca/ /usr/local/share/millstream-ca/
RUN python3 -m venv /opt/phoenix && \
    if ls /usr/local/share/millstream-ca/*.crt >/dev/null 2>&1; then \
      cat /usr/local/share/millstream-ca/*.crt > /opt/phoenix/ca.crt && \
      printf '[global]\ncert = /opt/phoenix/ca.crt\n' > /opt/phoenix/pip.conf; fi && \
    /opt/phoenix/bin/pip install "${PHOENIX_SPEC}"

# No outbound calls: no usage telemetry, no web fonts (the UI's own fallbacks).
ENV PHOENIX_WORKING_DIR=/data \
    PHOENIX_PORT=6006 \
    PHOENIX_GRPC_PORT=4317 \
    PHOENIX_TELEMETRY_ENABLED=false \
    PHOENIX_ALLOW_EXTERNAL_RESOURCES=false
EXPOSE 6006 4317
CMD ["/opt/phoenix/bin/phoenix", "serve"]
