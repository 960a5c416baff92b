#!/usr/bin/env bash
# Stage another commit's engine for an A/B in one device call: .ab_base/ (git-ignored) gets
# that commit's engine/ and proto/ beside this tree's benchmarks/, so run.sh's bench-base
# step times the same benchmark on the other engine, on the same machine as bench.
#
#   bash benchmarks/gpu/ab_base.sh <commit>
#   run(command="BENCH_COMMIT=<this commit> bash benchmarks/gpu/run.sh bench bench-base",
#       carry=[".whl", ".ficache.tgz", ".ab_base"])
set -euo pipefail
cd "$(dirname "$0")/../.."
commit=$(git rev-parse --short "${1:?usage: ab_base.sh <commit>}")
rm -rf .ab_base
mkdir .ab_base
git archive "$commit" engine proto | tar -x -C .ab_base
cp -r benchmarks pyproject.toml .ab_base/
echo "$commit" > .ab_base/COMMIT
echo "staged $commit in .ab_base ($(du -sh .ab_base | cut -f1))"
