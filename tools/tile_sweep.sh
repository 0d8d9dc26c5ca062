#!/bin/bash
# Times tile-size candidates without editing the tree: each candidate is built
# from a copy whose tile_sizes.h entry is rewritten, all builds in parallel, then
# benchmarked one after another (bfloat16, unmasked, the benchmark convention).
#   VARIANTS="fwd:128:128,64,4 bwd:128:64,64,8,2 sm90:128:128,176,2" bash tools/tile_sweep.sh
# fwd: FwdTile (sm80 forward), bwd: BwdTile, sm90: Sm90FwdTile (Hopper forward).
# fwd and sm90 variants are timed forward only, bwd variants forward+backward.
# Run from the repository root. Optional variables: OUT, WORK_DIR, SITE_DIR
# (tools/env.sh), VARIANTS, SWEEP_SEQS, SWEEP_PHASE.
# SWEEP_PHASE=build or bench runs one half (to overlap the builds with other work).
set -u
: "${VARIANTS:=fwd:128:128,64,4}"
: "${SWEEP_SEQS:=16384}"
: "${SWEEP_PHASE:=all}"
source "$(dirname "$0")/env.sh"
i=0
[ "$SWEEP_PHASE" = bench ] || for v in $VARIANTS; do
  IFS=: read -r dir_kind hd tile <<< "$v"
  dir=$WORK_DIR/sweep$i
  rm -rf $dir && mkdir -p $dir/src && tar --exclude=./build --exclude=./.git -cf - . | tar -xf - -C $dir/src
  case $dir_kind in
    fwd) table=FwdTile; subset="fwd_bf16_hdim${hd}_full" ;;
    bwd) table=BwdTile; subset="fwd_bf16_hdim${hd}_full,bwd_bf16_hdim${hd}_full" ;;
    sm90) table=Sm90FwdTile; subset="fwd_sm90_bf16_hdim${hd}_full,fwd_bf16_hdim${hd}_full" ;;
  esac
  sed -i -E "/constexpr $table /,/^}/ s/case $hd: return \{[^}]*\};/case $hd: return {${tile//,/, }};/" \
    $dir/src/csrc/cuda/tile_sizes.h
  grep -A12 "constexpr $table " $dir/src/csrc/cuda/tile_sizes.h | grep "case $hd:" > $dir/entry.txt
  (cd $dir/src && CMAKE_BUILD_PARALLEL_LEVEL=4 JFLASH_CUDA=ON JFLASH_CUDA_ARCHS=90a \
     JFLASH_CUDA_SUBSET="$subset" python3 -m pip install \
     --no-build-isolation --no-deps -q --target $dir/site . > $dir/build.log 2>&1 \
     || { echo "build $v failed"; tail -5 $dir/build.log; }) &
  i=$((i + 1))
done
wait
[ "$SWEEP_PHASE" = build ] && exit 0
i=0
for v in $VARIANTS; do
  IFS=: read -r dir_kind hd tile <<< "$v"
  dir=$WORK_DIR/sweep$i
  mode=$([ "$dir_kind" = bwd ] && echo fwdbwd || echo fwd)
  echo "== variant $v: $(cat $dir/entry.txt)"
  PYTHONPATH=$dir/site${SITE_DIR:+:$SITE_DIR} timeout 120 python3 -P tools/quick_bench.py \
    --head-dims $hd --seqs $SWEEP_SEQS --modes $mode --impls jflash 2>&1 | tail -n +3
  i=$((i + 1))
done 2>&1 | tee "$OUT/tile_sweep.log"
