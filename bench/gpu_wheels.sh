#!/usr/bin/env bash
# Fetch the wheels bench/gpu_check needs on a GPU image that lacks them at our pins, into .gpu-wheels/
# (gitignored; the device tool's run carries it: carry=[".gpu-wheels"]). What to fetch, and each wheel's
# size and sha256, is bench/gpu-wheels.lock; tests/unit/bench/test_gpu_wheels.py checks the lock against
# pyproject.toml's pins and the whole carried tree against the tool's 64 MiB.
#
#   bash bench/gpu_wheels.sh            # fetch and verify against the lock
#   bash bench/gpu_wheels.sh --update   # after changing a pin in the lock: fetch and rewrite the lock
#
# The wheels are for the GPU image's interpreter (CPython 3.12 on x86-64 Linux, see the device tool's
# KINDS.md), not for this machine's; bench/gpu_check installs them there with pip --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."

LOCK=bench/gpu-wheels.lock
DEST=.gpu-wheels
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

mapfile -t REQS < <(grep -v '^#' "$LOCK" | awk 'NF {print $1}')
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]/#/--platform=}" --dest "$DEST" "${REQS[@]}"

if [ "${1:-}" = "--update" ]; then
  {
    grep '^#' "$LOCK"
    for req in "${REQS[@]}"; do
      name="${req%%==*}"
      file="$(cd "$DEST" && ls | grep -i "^${name//-/_}-${req##*==}-")"
      echo "$req $file $(stat -c %s "$DEST/$file") $(sha256sum "$DEST/$file" | cut -d' ' -f1)"
    done
  } > "$LOCK.new"
  mv "$LOCK.new" "$LOCK"
fi

status=0
while read -r req file size sha; do
  if [ ! -f "$DEST/$file" ] || [ "$(stat -c %s "$DEST/$file")" != "$size" ] \
     || [ "$(sha256sum "$DEST/$file" | cut -d' ' -f1)" != "$sha" ]; then
    echo "gpu_wheels: $req did not give $file ($size bytes, sha256 $sha); see $LOCK" >&2
    status=1
  fi
done < <(grep -v '^#' "$LOCK")
[ "$status" = 0 ] || exit 1
echo "gpu_wheels: $(ls "$DEST" | wc -l) wheels, $(du -cb "$DEST"/*.whl | tail -1 | cut -f1) bytes in $DEST"
