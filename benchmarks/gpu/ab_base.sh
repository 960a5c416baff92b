#!/usr/bin/env bash
# Stage other engines for an A/B on one GPU host: .ab_base/ (git-ignored) gets one
# directory per engine, each holding that commit's engine/ and proto/ beside this tree's
# benchmarks/, so run.sh's bench-base and structured-base steps time the same benchmark on
# each of them, on the same machine as bench and structured. With patches (diffs of
# experiments not committed), each patch is applied to its own copy of the commit's engine:
# several experiments in one run.
#
#   bash benchmarks/gpu/ab_base.sh <commit> [patch ...]
#   AB_KEEP=1 bash benchmarks/gpu/ab_base.sh <another commit>   # adds to those staged
#
# then copy the repository with .whl/ and .ab_base/ to the GPU host and run there
#
#   BENCH_COMMIT=<this commit> bash benchmarks/gpu/run.sh bench bench-base
set -euo pipefail
cd "$(dirname "$0")/../.."
commit=$(git rev-parse --short "${1:?usage: ab_base.sh <commit> [patch ...]}")
shift
[ -n "${AB_KEEP:-}" ] || rm -rf .ab_base
mkdir -p .ab_base
stage() {  # stage <label> [patch]
    local dir=.ab_base/$1
    mkdir "$dir"
    git archive "$commit" engine proto | tar -x -C "$dir"
    [ -z "${2:-}" ] || git apply --directory="$dir" --include="$dir/engine/*" "$2"
    cp -r benchmarks pyproject.toml "$dir/"
    mkdir "$dir/tests" && cp tests/__init__.py tests/json_schemas.py "$dir/tests/"  # its schemas
    echo "$1" > "$dir/COMMIT"
    echo "staged $1 in $dir ($(du -sh "$dir" | cut -f1))"
}
if [ $# = 0 ]; then
    stage "$commit"
fi
for patch in "$@"; do
    stage "$commit+$(basename "$patch" .patch)" "$patch"
done
