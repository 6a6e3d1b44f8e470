#!/usr/bin/env bash
# How real models reach the GPU runner, which has no network and takes at most 64 MiB per call
# (repository included): ci/stage_parts.sh splits each assembled GGUF here into ordered 63 MiB
# parts under .stage/ (ignored by git) and detaches this checkout onto a slim tree, so that each
# call carries one part; this script, run in each call, appends the carried part to $BRASS_STAGE
# (a folder outside the working tree, which a warm runner keeps between consecutive calls) and,
# once a model is complete and its sha256 matches the catalog, moves it into $BRASS_CACHE/models
# with its stamp, where the catalog finds it.
#
#   here:   bash ci/stage_parts.sh split; bash ci/stage_parts.sh slim
#   runner: run(command="bash ci/gpu_stage.sh", carry=[".stage/X.gguf.part00"]), then part01, ...
#   here:   bash ci/stage_parts.sh back; then, on the same warm runner,
#           BRASS_CACHE=/tmp/brass-cache bash ci/gpu_conformance.sh (or gpu_twentysecond_session.sh real)
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${BRASS_STAGE:-/tmp/brass-stage}
export BRASS_CACHE=${BRASS_CACHE:-/tmp/brass-cache}
mkdir -p "$stage" "$BRASS_CACHE/models"
shopt -s nullglob
for part in .stage/*.part[0-9][0-9]; do
    base=$(basename "$part"); name=${base%.part*}; idx=${base##*.part}
    want=$(cat "$stage/$name.next" 2>/dev/null || echo 00)
    if [ "$idx" != "$want" ]; then
        echo "stage: $base out of order (expecting part $want); ignored"; continue
    fi
    cat "$part" >> "$stage/$name"
    printf '%02d' $((10#$idx + 1)) > "$stage/$name.next"
    echo "stage: $name +$(stat -c %s "$part") bytes = $(stat -c %s "$stage/$name")"
done
python3 - "$stage" <<'PY'
import hashlib, os, sys
from pathlib import Path
from brass import catalog
stage = Path(sys.argv[1])
for m in catalog.CATALOG.values():
    src = stage / m.filename
    if catalog.cached_path(m.name):
        print(f"stage: {m.name} ready in {catalog.cache_dir()}")
    elif src.is_file() and src.stat().st_size == m.size:
        h = hashlib.sha256()
        with open(src, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        if h.hexdigest() != m.sha256:
            sys.exit(f"stage: {m.name} assembled with sha256 {h.hexdigest()}, expected {m.sha256}")
        dst = catalog.cache_dir() / "models" / m.filename
        os.replace(src, dst)
        dst.with_name(dst.name + ".sha256").write_text(m.sha256 + "\n")
        print(f"stage: {m.name} verified and ready")
PY
