#!/bin/sh
# Every millstream service's entrypoint under Swarm (stack.yml mounts it as a config):
# each Swarm secret whose file name is a variable's name (/run/secrets/REDIS_PASSWORD,
# /run/secrets/MILLSTREAM_ADMIN_TOKEN) becomes that environment variable, then the command
# runs in this process's place. The values stay out of `docker service inspect`; other
# secrets (a TLS CA bundle: redis_ca.crt) are left as files. SECRETS_DIR: tests only.
for file in "${SECRETS_DIR:-/run/secrets}"/*; do
  [ -f "$file" ] || continue
  name="${file##*/}"
  case "$name" in
    [!A-Za-z_]* | *[!A-Za-z0-9_]*) continue ;;
  esac
  value="$(cat "$file")"
  export "$name=$value"
done
exec "$@"
