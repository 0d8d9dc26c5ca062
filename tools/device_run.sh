#!/bin/bash
# One call on a GPU machine, from the repository root: build, test, sanitize,
# time. Logs go to $OUT.
#   JFLASH_CUDA_SUBSET=... STEPS="build smoke tests suite sanitize decode bench" bash tools/device_run.sh
# Optional variables: OUT, WORK_DIR, SITE_DIR, WHEEL_DIR (tools/env.sh), and
#   STEPS              the steps below, in order (default: build tests sanitize bench)
#   JFLASH_CUDA_SUBSET what the build step compiles (default: ci)
#   JFLASH_CUDA_ARCHS  its architectures (default: 90a)
#   BUILD_JOBS         its parallel compile jobs (default: ninja's own, the number of
#                      CPUs + 2, which a user's pip install gets)
#   JFLASH_CUDA_SM80_HOPPER_SASS  sm_90a SASS for the sm80 kernels too (default: ON
#                      here, unlike a user's build, so that the tests and comparisons
#                      that force the sm80 kernels on Hopper do not wait for the
#                      driver's compile of their PTX; OFF to time a user's build)
#   BENCH_ARGS         quick_bench.py's arguments for the bench step
#   TEST_K             a pytest -k expression for the tests step (default: every test)
#   SANITIZE_ARGS      sanitizer_driver.py's arguments for the sanitize step
#   GRID_ARGS          benchmarks/gpu_benchmark.py's arguments for the grid step
#                      (its results go to $OUT/grid.json)
#   SUITE_TIMEOUT      seconds each of the suite step's pytest groups may run (default: 480)
set -u
: "${STEPS:=build tests sanitize bench}"
: "${JFLASH_CUDA_SUBSET:=ci}"
: "${JFLASH_CUDA_ARCHS:=90a}"
: "${BUILD_JOBS:=}"
: "${BENCH_ARGS:=--head-dims 128 --seqs 16384}"
: "${TEST_K:=}"
: "${SANITIZE_ARGS:=}"
: "${GRID_ARGS:=--head-dims 128 --seqs 4096 16384}"
: "${SUITE_TIMEOUT:=480}"
source "$(dirname "$0")/env.sh"
if [ -n "${WHEEL_DIR:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE_DIR" "$WHEEL_DIR"/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
# Warp-state samples per SASS instruction of one launch of the kernels matching
# a regex (head dim NCU_HEAD_DIM, default 128; seq 4k; NCU_CAUSAL), summarized per opcode and
# instruction (ncu_source_summary.py); name: the prefix of the files in $OUT;
# mode: quick_bench.py's --modes.
ncu_source_step() {
  local name=$1 kernel=$2 mode=$3
  timeout 180 ncu --clock-control none --kernel-name regex:"$kernel" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --import-source no -o "$OUT/$name" \
    python3 -P tools/quick_bench.py --head-dims ${NCU_HEAD_DIM:-128} --seqs 4096 --modes "$mode" \
    --impls jflash --iterations 1 --repeats 1 --causal ${NCU_CAUSAL:-no} > "$OUT/$name.log" 2>&1
  echo "ncu rc=$?"
  ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
  ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.csv" 2>&1
  grep -E "Duration|Elapsed Cycles|SM Frequency" "$OUT/${name}_details.txt"
  python3 tools/ncu_source_summary.py "$OUT/$name.csv" --top 15
}
for step in $STEPS; do
  start=$(date +%s)
  case $step in
    build)
      CMAKE_BUILD_PARALLEL_LEVEL=$BUILD_JOBS JFLASH_CUDA=ON JFLASH_CUDA_ARCHS="$JFLASH_CUDA_ARCHS" \
        JFLASH_CUDA_SUBSET="$JFLASH_CUDA_SUBSET" \
        JFLASH_CUDA_SM80_HOPPER_SASS="${JFLASH_CUDA_SM80_HOPPER_SASS:-ON}" \
        python3 -m pip install --no-build-isolation --no-deps -v . 2>&1 | python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write(f"{time.time() - t0:8.2f} {line}")' > "$OUT/build.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
      # When each phase began (seconds from pip's start): configure, compile, wheel.
      grep -E "\*\*\* |Successfully installed" "$OUT/build.log"
      ls -l build/*/libjflash_cuda.so
      # ninja's log: start and end (ms) of every unit, where the build's time went.
      cp build/*/.ninja_log "$OUT/ninja_log.txt" 2>/dev/null
      python3 -P -c "import jflash; print('HAS_CUDA_KERNELS', jflash.HAS_CUDA_KERNELS)" ;;
    smoke)  # a hang or a wrong result stops the call here
      timeout 120 python3 -P tools/smoke.py 2>&1 | tee "$OUT/smoke.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1 ;;
    tests)
      timeout 300 python3 -P -m pytest -q -p no:cacheprovider tests/test_cuda_specific.py \
        ${TEST_K:+-k "$TEST_K"} > "$OUT/test_cuda.log" 2>&1
      tail -25 "$OUT/test_cuda.log" ;;
    decode)  # the decode kernel: its CUDA checks, the option grid, and compute-sanitizer
      timeout 480 python3 -P -m pytest -q -p no:cacheprovider tests/test_decode_cuda.py \
        tests/test_decode.py > "$OUT/test_decode.log" 2>&1
      tail -25 "$OUT/test_decode.log"
      for tool in memcheck racecheck; do
        timeout 300 compute-sanitizer --tool $tool --kernel-name kns=flash_decode \
          python3 -P tools/sanitizer_decode.py --head-dims 64 128 256 > "$OUT/sanitizer_decode_$tool.log" 2>&1
        echo "decode $tool rc=$?"; tail -4 "$OUT/sanitizer_decode_$tool.log"
      done ;;
    suite)  # every file of tests/ in six parallel pytest processes, without XLA's
      # autotuning, whose tuning of the reference computations' compiles made each
      # test several times slower. Built without JFLASH_CUDA_SM80_HOPPER_SASS, the
      # tests that force the sm80 kernels on Hopper wait for the driver's compile of
      # their PTX (cuda_other then ran past 480 s on an H200: raise SUITE_TIMEOUT)
      run_group() {  # name, pytest arguments...
        local name=$1; shift
        ( XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $SUITE_TIMEOUT python3 -P -m pytest -q -p no:cacheprovider "$@" \
            > "$OUT/test_suite_$name.log" 2>&1; echo "$name rc=$?: $(tail -1 "$OUT/test_suite_$name.log")" ) &
      }
      run_group cuda_ref tests/test_cuda_specific.py -k test_against_reference
      run_group cuda_other tests/test_cuda_specific.py -k "not test_against_reference"
      run_group core tests/test_flash_attention.py tests/test_dot_product_attention.py
      # Every other file, dealt in turn into three groups (of
      # two, one ran past 545 s on an H200).
      rest=($(ls tests/test_*.py | grep -v -e test_cuda_specific -e test_flash_attention \
        -e test_dot_product_attention))
      for i in 0 1 2; do
        run_group rest_$i $(printf '%s\n' "${rest[@]}" | awk -v i=$i 'NR % 3 == i')
      done
      wait ;;
    sanitize)
      for tool in memcheck racecheck; do
        for attempt in 1 2; do  # the tool itself once crashed (rc 139) mid-run: retry once
          timeout 150 compute-sanitizer --tool $tool --kernel-name kns=flash_ \
            python3 -P tools/sanitizer_driver.py $SANITIZE_ARGS > "$OUT/sanitizer_$tool.log" 2>&1
          rc=$?; echo "$tool attempt $attempt rc=$rc"; tail -4 "$OUT/sanitizer_$tool.log"
          [ $rc -ne 139 ] && break
        done
      done ;;
    ab)
      bash tools/ab_bench.sh ;;
    sweep)
      bash tools/tile_sweep.sh ;;
    ncu)  # hardware counters for one launch of the Hopper forward (head dim 128, seq 16k)
      timeout 180 ncu --clock-control none --kernel-name regex:flash_fwd_sm90 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --metrics regex:smsp__pcsamp_warps_issue_stalled_.* \
        python3 -P tools/quick_bench.py --head-dims 128 --seqs 16384 --modes fwd \
        --impls jflash --iterations 1 --repeats 1 --causal ${NCU_CAUSAL:-no} > "$OUT/ncu.log" 2>&1
      echo "ncu rc=$?"; grep -E "Duration|Issue Slots|Eligible|Tensor|pcsamp" "$OUT/ncu.log" \
        | grep -v " 0$" | head -40 ;;
    ncu_source)  # warp-state samples per SASS instruction, one launch (seq 4k)
      ncu_source_step ncu_source flash_fwd_sm90 fwd ;;
    ncu_bwd)  # hardware counters for one launch of the backward's main kernel (Hopper or sm80,
      # as the handler picks; head dim 128, seq 16k)
      timeout 240 ncu --clock-control none --kernel-name regex:'flash_bwd_(sm90_)?kernel' --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis_Tables --section InstructionStats \
        --metrics regex:smsp__pcsamp_warps_issue_stalled_.* \
        python3 -P tools/quick_bench.py --head-dims 128 --seqs 16384 --modes fwdbwd \
        --impls jflash --iterations 1 --repeats 1 --causal ${NCU_CAUSAL:-no} > "$OUT/ncu_bwd.log" 2>&1
      echo "ncu rc=$?"; grep -E "Duration|Issue Slots|Eligible|Tensor|pcsamp|Bank|Shared" "$OUT/ncu_bwd.log" \
        | grep -v " 0$" | head -60 ;;
    ncu_bwd_source)  # the same for the backward's main kernel (NCU_CAUSAL=yes: the band kernel)
      ncu_source_step ncu_bwd_source 'flash_bwd_(sm90_)?kernel' fwdbwd ;;
    bench)
      timeout 240 python3 -P tools/quick_bench.py $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" ;;
    grid)  # jflash beside cuDNN, recorded with the device, jax version and commit
      timeout 480 python3 -P benchmarks/gpu_benchmark.py $GRID_ARGS --out "$OUT/grid.json" \
        > "$OUT/grid.log" 2>&1
      echo "grid rc=$?"; tail -60 "$OUT/grid.log" ;;
  esac
  echo "== $step took $(( $(date +%s) - start )) s"
done
