#!/usr/bin/env bash
# The vLLM bundle for the GPU host in four parts (.device/a, b, d, c) instead of the shared
# script's three: a transfer carries the tracked tree (~20 MB of results) plus one part and
# holds 64 MiB, so parts of ~55 MB no longer fit. Run from the repository root:
#
#   bash tools/device_bundle.sh
#
# then, back to back on one warm host: carry .device/a `mkdir -p /tmp/stage && cp .device/a/*
# /tmp/stage/`; carry .device/b, then .device/d: `cp .device/X/* /tmp/stage/`; carry .device/c:
# `.device/c/install-vllm && PYTHONPATH=/tmp/site:. ...` (install-vllm joins the archive's
# pieces in name order and installs every wheel staged).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
../shared/device/bundle-vllm
cache=${MOIRA_BUNDLE_CACHE:-$HOME/.cache/moira-device-bundle}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp .device/a/* .device/b/* .device/c/* "$work/"
(cd "$work" && cat vllm-slim.tar.xz.? > archive && rm vllm-slim.tar.xz.?)
cmp "$work/archive" "$cache/vllm-slim.tar.xz"  # the shared script's pieces, joined, are the archive
(cd "$work" && split -b 37000000 -d -a 1 archive vllm-slim.tar.xz. && rm archive)
rm -rf .device/a .device/b .device/c .device/d
mkdir -p .device/a .device/b .device/c .device/d
parts=(a b d)
for i in 0 1 2; do
  [ -f "$work/vllm-slim.tar.xz.$i" ] && mv "$work/vllm-slim.tar.xz.$i" ".device/${parts[$i]}/"
done
[ ! -e "$work/vllm-slim.tar.xz.3" ] || { echo "the archive needs more than three pieces" >&2; exit 1; }
mv "$work/install-vllm" .device/c/
# the wheels, largest first, each to the lightest part
for wheel in $(ls -S "$work"/*.whl); do
  lightest=$(du -sb .device/a .device/b .device/c .device/d | sort -n | head -1 | cut -f2)
  mv "$wheel" "$lightest/"
done
du -sb .device/a .device/b .device/c .device/d >&2
