#!/usr/bin/env bash
# Stage another commit's engine for an A/B in one device call: .ab_base/ (git-ignored) gets
# that commit's engine/ and proto/ beside this tree's benchmarks/, so run.sh's bench-base
# step times the same benchmark on the other engine, on the same machine as bench. A patch
# (the diff of an experiment not on main) is applied to that engine.
#
#   bash benchmarks/gpu/ab_base.sh <commit> [patch]
#   run(command="BENCH_COMMIT=<this commit> bash benchmarks/gpu/run.sh bench bench-base",
#       carry=[".whl", ".ficache.tgz", ".ab_base"])
set -euo pipefail
cd "$(dirname "$0")/../.."
commit=$(git rev-parse --short "${1:?usage: ab_base.sh <commit> [patch]}")
patch=${2:-}
rm -rf .ab_base
mkdir .ab_base
git archive "$commit" engine proto | tar -x -C .ab_base
if [ -n "$patch" ]; then
    git apply --directory=.ab_base --include='.ab_base/engine/*' "$patch"
    commit="$commit+$(basename "$patch" .patch)"
fi
cp -r benchmarks pyproject.toml .ab_base/
echo "$commit" > .ab_base/COMMIT
echo "staged $commit in .ab_base ($(du -sh .ab_base | cut -f1))"
