#!/bin/bash
# A/B timing of source trees in one call: the working tree ("new") against
# trees under .dev/ab/ (e.g. `git archive <commit> --prefix=base/ | tar -x -C
# .dev/ab`; carry .dev). All are built in parallel with the same subset, then
# timed in turns (base, v1, ..., new, base, ...) so that clock drift hits all
# alike. AB_TREES names the .dev/ab/ trees ("new" is the working tree).
#   AB_TREES="base new" AB_SUBSET=bf16_hdim128 AB_BENCH="--head-dims 128 --modes fwdbwd" \
#     bash csrc/cuda/tools/ab_bench.sh
# Run after device_run.sh's wheel install (needs /tmp/site on PYTHONPATH).
# AB_PHASE=build or bench runs one half (e.g. build every tree once, then time
# several pairs with different AB_BENCH). Summarize the log with
# tools/ab_summary.py; use 3 or more rounds at seq <= 1024, where medians move
# by 5-10% from one round to the next (NOTES.md, s8).
set -u
: "${OUT:=/tmp/out}"
: "${AB_SUBSET:=bf16_hdim128}"
: "${AB_BENCH:=--head-dims 128 --seqs 16384 --modes fwdbwd}"
: "${AB_ROUNDS:=2}"
: "${AB_TREES:=base new}"
: "${AB_PHASE:=all}"
export PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
[ "$AB_PHASE" = bench ] || for side in $AB_TREES; do
  src=$([ $side = new ] && echo . || echo .dev/ab/$side)
  rm -rf /tmp/ab_$side && mkdir -p /tmp/ab_$side
  (cd $src && CMAKE_BUILD_PARALLEL_LEVEL=${AB_JOBS:-8} JFLASH_CUDA=ON JFLASH_CUDA_ARCHS=90a \
     JFLASH_CUDA_SUBSET="$AB_SUBSET" python3 -m pip install --no-build-isolation --no-deps -q \
     --target /tmp/ab_$side/site . > /tmp/ab_$side/build.log 2>&1 \
     || { echo "build $side failed"; tail -20 /tmp/ab_$side/build.log; }) &
done
wait
[ "$AB_PHASE" = build ] && exit 0
for round in $(seq "$AB_ROUNDS"); do
  for side in $AB_TREES; do
    echo "== $side (round $round)"
    PYTHONPATH=/tmp/ab_$side/site:/tmp/site timeout 200 python3 -P csrc/cuda/tools/quick_bench.py \
      $AB_BENCH --impls jflash 2>&1 | tail -n +3
  done
done 2>&1 | tee -a "$OUT/ab_bench.log"
