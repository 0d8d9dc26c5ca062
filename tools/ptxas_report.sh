#!/bin/bash
# Compiles kernel instantiations here (no GPU needed) with ptxas's resource
# report and prints, per file, registers, spills and any wgmma warning. Exits 1
# when ptxas serializes wgmma (C7511 / C7514 / C7515: every wgmma of the kernel
# then waits for the one before, a silent 2x slowdown that no test catches) or
# injects a wgmma wait (C7517). docs/cuda_kernels.md (Compiler pitfalls) says what causes them.
#   bash tools/ptxas_report.sh [arch] [name fragment ...]
#   bash tools/ptxas_report.sh 90a fwd_sm90_bf16       # the default
# Runs from any directory; uses the cutlass and jaxlib of `python3`
# (pick the interpreter with PATH or pyenv). JOBS=n compiles n files at a time (default 2).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
arch=${1:-90a}; shift || true
fragments=("${@:-fwd_sm90_bf16}")
cutlass=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))") || exit 2
jaxlib=$(python3 -c "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))") || exit 2
out=$(mktemp -d)
files=()
for f in "$root"/csrc/cuda/instantiations/*.cu; do
  for frag in "${fragments[@]}"; do
    [[ $(basename "$f") == *"$frag"* ]] && { files+=("$f"); break; }
  done
done
[ ${#files[@]} -gt 0 ] || { echo "no instantiation matches ${fragments[*]}"; exit 2; }
compile() {
  local f=$1 name; name=$(basename "$f" .cu)
  nvcc -cubin -gencode=arch=compute_${arch},code=sm_${arch} -O3 --expt-relaxed-constexpr -std=c++17 \
    -Xptxas -v -I "$root/csrc" -I "$root/csrc/include" -isystem "$cutlass" -isystem "$jaxlib" \
    -DJFLASH_BUILD_JAXLIB_VERSION='"report"' -DJFLASH_CUDA_SUBSET='"report"' \
    -o "$out/$name.cubin" "$f" > "$out/$name.log" 2>&1 || echo "compile failed" >> "$out/$name.log"
}
export -f compile; export arch root cutlass jaxlib out
printf '%s\n' "${files[@]}" | xargs -P "${JOBS:-2}" -I{} bash -c 'compile {}'
status=0
for f in "${files[@]}"; do
  name=$(basename "$f" .cu); log="$out/$name.log"
  # A file may hold several kernels (e.g. a second tile): all register counts,
  # the largest spill.
  regs=$(grep -o 'Used [0-9]*' "$log" | awk '{print $2}' | paste -sd/ | sed 's/^/Used /; s/$/ registers/')
  spill=$(grep -o '[0-9]* bytes spill stores, [0-9]* bytes spill loads' "$log" | sort -n | tail -1)
  flags=$(grep -o 'C75[0-9][0-9]' "$log" | sort -u | tr '\n' ' ')
  printf '%-44s %-22s %-40s %s\n' "$name" "$regs" "$spill" "${flags:-}"
  grep -q 'compile failed' "$log" && { tail -20 "$log"; status=1; }
  grep -qE 'C751[1457]' "$log" && status=1
done
rm -rf "$out"
exit $status
