#!/usr/bin/env bash
# `make gpu-bundle`: .gpu/ (ignored by git), what a GPU machine without network lacks to run
# millstream and `make gpu-check`: the wheels of scripts/gpu_wheels.txt for its Python
# (GPU_PYTHON, default 3.12; its image's packages are scripts/gpu_image.txt), redis-server with
# its libraries, a `millstream` command, and the commit it was made at (.gpu/commit: no .git
# travels). About 20 MB. GPU_BUNDLE=DIR writes DIR instead of .gpu (the CPU dry run of the
# set-up, tests/unit/deploy/test_gpu_bundle.py, makes one for this machine's Python).
set -euo pipefail
cd "$(dirname "$0")/.."
G=${GPU_BUNDLE:-.gpu}
PYV=${GPU_PYTHON:-3.12}
rm -rf "$G" && mkdir -p "$G/whl" "$G/bin" "$G/lib"
pkgs=$(grep -v '^#' scripts/gpu_wheels.txt | grep .)
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$G/whl" $pkgs
command -v redis-server >/dev/null || { echo "redis-server not found: apt-get install redis-server" >&2; exit 2; }
cp "$(command -v redis-server)" "$G/bin/redis-server.real"
for l in $(ldd "$(command -v redis-server)" | awk '/=>/ {print $3}'); do
  case "$(basename "$l")" in libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*) ;; *) cp -L "$l" "$G/lib/" ;; esac
done
printf '#!/bin/bash\nD="$(cd "$(dirname "$0")" && pwd)"\nLD_LIBRARY_PATH="$D/../lib" exec -a redis-server "$D/redis-server.real" "$@"\n' > "$G/bin/redis-server"
printf '#!/bin/bash\nexec python3 -m millstream.cli "$@"\n' > "$G/bin/millstream"
chmod +x "$G"/bin/*
echo "$PYV" > "$G/python-version"
# The table names the commit it measured; +dirty as bench_gpu.py writes it: the working tree
# that travels holds changes the commit does not.
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
  commit="$commit+dirty"
fi
echo "$commit" > "$G/commit"
echo "[gpu-bundle] $(du -sh "$G" | cut -f1) in $G for Python $PYV at $commit: carry it (.gpu) and run make gpu-check there"
