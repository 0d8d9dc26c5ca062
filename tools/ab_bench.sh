#!/bin/bash
# A/B timing of source trees in one call: the working tree ("new") against
# trees under $AB_DIR (default .dev/ab, ignored by git; e.g. `git archive
# <commit> --prefix=base/ | tar -x -C .dev/ab`). All are built in parallel with
# the same subset (or each its own), then timed in turns (base, v1, ..., new,
# base, ...) so that clock drift hits all alike. AB_TREES names the $AB_DIR
# trees ("new" is the working tree). Run from the repository root.
#   AB_TREES="base new" AB_SUBSET=bf16_hdim128 AB_BENCH="--head-dims 128 --modes fwdbwd" \
#     bash tools/ab_bench.sh
# Optional variables: OUT, WORK_DIR, SITE_DIR (tools/env.sh), AB_JOBS, AB_IMPLS
# (quick_bench.py's --impls, default jflash), AB_SUBSET_<tree> (that tree's
# own subset in place of AB_SUBSET, for trees that are timed on different
# AB_BENCH runs: e.g. forward variants built with their forward units only;
# read for trees whose names are shell identifiers, others take AB_SUBSET).
# AB_PHASE=build or bench runs one half (e.g. build every tree once, then time
# several pairs with different AB_BENCH). Summarize the log with
# tools/ab_summary.py; use 3 or more rounds at seq <= 1024, where medians move
# by 5-10% from one round to the next (docs/cuda_kernels.md, Measuring).
set -u
: "${AB_SUBSET:=bf16_hdim128}"
: "${AB_BENCH:=--head-dims 128 --seqs 16384 --modes fwdbwd}"
: "${AB_ROUNDS:=2}"
: "${AB_TREES:=base new}"
: "${AB_PHASE:=all}"
: "${AB_DIR:=.dev/ab}"
source "$(dirname "$0")/env.sh"
[ "$AB_PHASE" = bench ] || for side in $AB_TREES; do
  src=$([ $side = new ] && echo . || echo "$AB_DIR/$side")
  subset=$AB_SUBSET
  if [[ $side =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
    subset_var=AB_SUBSET_$side
    subset=${!subset_var:-$AB_SUBSET}
  fi
  rm -rf $WORK_DIR/ab_$side && mkdir -p $WORK_DIR/ab_$side
  (cd $src && CMAKE_BUILD_PARALLEL_LEVEL=${AB_JOBS:-8} JFLASH_CUDA=ON JFLASH_CUDA_ARCHS=90a \
     JFLASH_CUDA_SUBSET="$subset" python3 -m pip install --no-build-isolation --no-deps -q \
     --target $WORK_DIR/ab_$side/site . > $WORK_DIR/ab_$side/build.log 2>&1 \
     || { echo "build $side failed"; tail -20 $WORK_DIR/ab_$side/build.log; }) &
done
wait
[ "$AB_PHASE" = build ] && exit 0
for round in $(seq "$AB_ROUNDS"); do
  for side in $AB_TREES; do
    echo "== $side (round $round)"
    PYTHONPATH=$WORK_DIR/ab_$side/site${SITE_DIR:+:$SITE_DIR} timeout 200 python3 -P tools/quick_bench.py \
      $AB_BENCH --impls ${AB_IMPLS:-jflash} 2>&1 | tail -n +3
  done
done 2>&1 | tee -a "$OUT/ab_bench.log"
