#!/usr/bin/env bash
# Rebuild ebpf/*.bpf.o from source into a scratch folder and fail if any differs from the
# committed object (the build is path-independent, so any clone must reproduce it exactly).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash ebpf/build.sh "$tmp"
status=0
for obj in ebpf/*.bpf.o; do
  name=$(basename "$obj")
  if ! cmp -s "$obj" "$tmp/$name"; then
    echo "check-bpf-objects: $obj differs from a rebuild of its source; run 'bash ebpf/build.sh' and commit the result" >&2
    status=1
  else
    echo "check-bpf-objects: $obj matches its source ($(sha256sum "$obj" | cut -c1-16))"
  fi
done
exit $status
