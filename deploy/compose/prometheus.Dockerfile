# The observability profiles' Prometheus: Debian's package (its classic web UI on 9090), built
# FROM the base millstream's image uses: no image registry needed, only a Debian mirror.
# compose.yml mounts prometheus.yml over the config.
#
#   docker build -f deploy/compose/prometheus.Dockerfile -t millstream-prometheus .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

RUN apt-get update -qq && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus && \
    rm -rf /var/lib/apt/lists/*
COPY deploy/compose/prometheus.yml /etc/prometheus/prometheus.yml
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus", \
     "--web.listen-address=:9090"]
