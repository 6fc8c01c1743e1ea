#!/usr/bin/env bash
# Run a voxpipe command on the GPU machine (device tool) without installing the package:
#   bash bench/device.sh voxpipe bench --quick
# Expects the missing wheels in .whl/ carried along (installed below into /tmp/site); maps the repo
# folders onto the `voxpipe` package the way pyproject.toml does. `voxpipe bench` needs, beside what
# the image has: the gateway's (fastapi uvicorn starlette pydantic ... soundfile for voice input,
# websockets + silero-vad for the realtime workload) and the openai SDK for the gateway clients:
#   ../shared/device/wheels.sh openai jiter distro sniffio tqdm httpx2 httpcore2 truststore xgrammar apache-tvm-ffi \
#     jsonschema jsonschema-specifications referencing rpds-py attrs   (what 2026-12-04's calls carried)
# (the thinker imports xgrammar, which needs apache-tvm-ffi: without them the thinker does not start)
# (wheels.sh's own list already has websockets, soundfile and silero-vad); the bench says which
# package is missing before it starts anything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if ls "$root"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$root"/.whl/*.whl
fi
pkg=/tmp/vp/voxpipe
rm -rf /tmp/vp && mkdir -p "$pkg"
cp -r "$root"/voxpipe/. "$pkg"/
ln -s "$root/services" "$pkg/services"
ln -s "$root/gateway" "$pkg/gateway"
ln -s "$root/kernels" "$pkg/kernels"
ln -s "$root/bench" "$pkg/bench"
ln -s "$root/proto/voxpipe/v1" "$pkg/v1"
export PYTHONPATH=/tmp/vp:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
cd /tmp/vp  # so that `python -m` does not pick up the repo's bare voxpipe/ folder
if [ "${1:-}" = "voxpipe" ]; then shift; exec python3 -m voxpipe.cli "$@"; fi
exec "$@"
