#!/usr/bin/env bash
# Here-side half of ci/gpu_stage.sh: gets the catalog's real models onto the GPU runner in as few
# calls as its 64 MiB limit allows. That limit covers the whole working tree, and the tracked tree
# is ~31 MB (golden/ mostly), so with it a call carries one 30 MiB part: 29 calls for the three
# models, each one a chance for the runner to go idle (30 s) and drop what was staged. With a slim
# checkout (the files ci/gpu_stage.sh needs, and this script) a call carries one 63 MiB part: 14 calls.
#
#   bash ci/stage_parts.sh split   # .stage/<gguf>.partNN, 63 MiB each, of the catalog's cached models
#   bash ci/stage_parts.sh slim    # detach HEAD onto a commit of those six files (main untouched)
#   ... run(command="bash ci/gpu_stage.sh", carry=[".stage/<gguf>.partNN"]) per part, in order ...
#   bash ci/stage_parts.sh back    # check main out again (the full tree) for the calls that test
#
# A suite started before `slim` by `gpu_twentysecond_session.sh suite_bg` runs from its own copy
# in /tmp on the runner, so the slim tree cannot change files under it.
set -euo pipefail
cd "$(dirname "$0")/.."
part_mib=${PART_MIB:-63}        # + the slim tree (~20 KB) stays under the 64 MiB a call carries
slim_paths=(.gitignore ci/gpu_stage.sh ci/stage_parts.sh engine/__init__.py engine/catalog.py engine/errors.py)
branch_file=.stage/slim-from    # the branch `slim` left, for `back`

case "${1:-}" in
split)
    models=$(python3 -c "from brass import catalog; print(catalog.cache_dir() / 'models')")
    mkdir -p .stage
    rm -f .stage/*.gguf.part[0-9][0-9]
    for nf in $(python3 -c "from brass import catalog; print(*(f'{m.name}:{m.filename}' for m in catalog.CATALOG.values()))"); do
        name=${nf%%:*}; f=${nf#*:}
        if [ -f "$models/$f" ]; then
            split -b "${part_mib}m" -d -a 2 "$models/$f" ".stage/$f.part"
        else
            echo "not in $models: $f (python3 -c 'from brass import catalog; catalog.fetch(\"$name\")' fetches it)"
        fi
    done
    ls -l .stage/*.gguf.part[0-9][0-9] 2> /dev/null | awk '{print $5, $NF}'
    echo "$(ls .stage/*.gguf.part[0-9][0-9] 2> /dev/null | wc -l) parts: one staging call each, in this order"
    ;;
slim)
    if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
        echo "uncommitted changes: commit them first (the slim checkout would carry them off)"; exit 1
    fi
    from=$(git symbolic-ref -q --short HEAD) || { echo "HEAD is detached already (slim?)"; exit 1; }
    idx=$(mktemp); trap 'rm -f "$idx"' EXIT
    GIT_INDEX_FILE=$idx git read-tree --empty
    for p in "${slim_paths[@]}"; do
        GIT_INDEX_FILE=$idx git update-index --add --cacheinfo "$(git ls-tree HEAD -- "$p" | awk '{print $1","$3}')","$p"
    done
    tree=$(GIT_INDEX_FILE=$idx git write-tree)
    commit=$(git commit-tree "$tree" -p HEAD -m "slim tree for the GPU runner's staging calls (not a branch)")
    mkdir -p .stage && echo "$from" > "$branch_file"
    git checkout -q --detach "$commit"
    # what a call sends besides the carried part: tracked files and untracked ones not ignored
    bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
    echo "slim checkout of ${#slim_paths[@]} files ($bytes bytes travel with each part); \`bash ci/stage_parts.sh back\` returns to $from"
    [ "$bytes" -lt $(( (64 - part_mib) << 20 )) ] || echo "warning: that and a ${part_mib} MiB part exceed the 64 MiB a call carries"
    ;;
back)
    from=$(cat "$branch_file" 2>/dev/null || echo main)
    git checkout -q "$from" && rm -f "$branch_file" && echo "back on $from ($(git rev-parse --short HEAD))"
    ;;
*)
    sed -n '2,14p' "$0"; exit 2
    ;;
esac
