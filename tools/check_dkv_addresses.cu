// Host-side check of the float32 dK/dV staging addresses of stage_dk_dv
// (epilogue_bwd_sm90.h): four base addresses plus immediates per thread
// (BwdTraitsSm90::dkv_accum_base, dkv_accum_offset) against CuTe's own
// partition of the swizzled layout, for every consumer thread and accumulator
// pair of the tiles that stage through shared memory (kDkvThroughSmem).
//   nvcc -std=c++17 --expt-relaxed-constexpr -I csrc -I csrc/include \
//     -isystem <cutlass include> -isystem <jaxlib include> tools/check_dkv_addresses.cu
#include <cstdio>
#include "cuda/sm90/traits_bwd_sm90.h"
using namespace cute;
using namespace jflash;
using namespace jflash::cuda::sm90;
template <typename Traits>
int check(const char* name) {
  static_assert(Traits::kDkvThroughSmem,
                "this tile's dK and dV do not stage through shared memory");
  using Layout = typename Traits::SmemLayoutdKVAccum;
  static float buf[cosize_v<Layout> + 64];
  float* base = buf;
  Tensor sdK = make_tensor(make_smem_ptr(base), Layout{});
  typename Traits::TiledMmadKV mma;
  int bad = 0, total = 0;
  for (int tidx = 0; tidx < Traits::kConsumerThreads; ++tidx) {
    auto thr = mma.get_thread_slice(tidx);
    Tensor ref = thr.partition_C(sdK);
    Tensor cdKV = thr.partition_C(
        make_identity_tensor(Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}));
    const int row0 = get<0>(cdKV(0)), col0 = get<1>(cdKV(0));
    long k_addr[4];
    for (int c = 0; c < 4; ++c) k_addr[c] = &sdK(row0, col0 + 8 * c) - base;
    for (int i = 0; i < size(ref); i += 2) {
      const int dr = get<0>(cdKV(i)) - row0, dc = get<1>(cdKV(i)) - col0;
      long got = k_addr[Traits::dkv_accum_base(dc)] + Traits::dkv_accum_offset(dr, dc);
      long want = &ref(i) - base;
      long want1 = &ref(i + 1) - base;
      ++total;
      if (got != want || want1 != want + 1) {
        if (bad < 5) {
          printf("%s tidx %d i %d got %ld want %ld (+1: %ld)\n", name, tidx, i, got, want, want1);
        }
        ++bad;
      }
    }
  }
  printf("%s: %d of %d pairs wrong\n", name, bad, total);
  return bad;
}
int main() {
  int bad = 0;
  bad += check<BwdTraitsSm90<cutlass::bfloat16_t, 128, MaskKind::kBand>>("hd128 band");
  bad += check<BwdTraitsSm90<cutlass::bfloat16_t, 128, MaskKind::kNone>>("hd128 full");
  bad += check<BwdTraitsSm90<cutlass::bfloat16_t, 64, MaskKind::kBand>>("hd64 band own keys");
  bad += check<BwdTraitsSm90<cutlass::bfloat16_t, 64, MaskKind::kBand, ScoreKind::kPlain, true>>(
      "hd64 band ordered");
  bad += check<BwdTraitsSm90<cutlass::bfloat16_t, 64, MaskKind::kNone>>("hd64 full");
  bad += check<BwdTraitsSm90<cutlass::bfloat16_t, 256, MaskKind::kNone>>("hd256 full");
  bad += check<BwdTraitsSm90<cutlass::bfloat16_t, 128, MaskKind::kSegments, ScoreKind::kSoftcap>>(
      "hd128 seg softcap");
  return bad != 0;
}
