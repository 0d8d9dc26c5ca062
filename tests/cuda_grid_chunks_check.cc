// Host-side check of the sm80 launchers' grid chunks (csrc/cuda/launch.h:
// for_each_grid_chunk, fwd_params_chunk, bwd_params_chunk), no GPU needed:
// every (batch, head) is launched exactly once, in the order of one launch
// where the heads fit; every chunk fits CUDA's grid limits; and the addresses
// that the kernels compute from a chunk's params and their blockIdx (as
// flash_fwd_kernel_sm80.h and flash_bwd_kernel_sm80.h do) are those of the
// whole call. Compiled and run by tests/test_cuda_library.py; prints "ok".
#include <cstdint>
#include <cstdio>
#include <vector>

#include "host_check.h"
#include "cuda/launch.h"

using namespace jflash;
using namespace jflash::cuda;

namespace {

// Element `index` of a 16-bit tensor at ptr, as an address.
const char* at(const void* ptr, int64_t index) { return static_cast<const char*>(ptr) + 2 * index; }

// Dense [batch, seq, heads, head_dim] strides, as params_from_ffi.h sets them.
void dense(int seq, int heads, int head_dim, int64_t& batch_stride, int64_t& row_stride,
           int64_t& head_stride) {
  head_stride = head_dim;
  row_stride = int64_t{heads} * head_dim;
  batch_stride = int64_t{seq} * heads * head_dim;
}

BwdParams make_params(int batch, int heads, int heads_kv, int seq_q, int seq_k, int head_dim,
                      bool deterministic, bool caller_accum) {
  BwdParams p{};
  p.dtype = DType::kBFloat16;
  // Distinct fake base addresses, never dereferenced.
  auto base = [](uint64_t i) { return reinterpret_cast<void*>(uint64_t{1} << 44 | i << 40); };
  p.q = base(1), p.k = base(2), p.v = base(3), p.out = base(4);
  p.lse = static_cast<float*>(base(5));
  p.dout = base(6), p.dq = base(8), p.dk = base(9), p.dv = base(10);
  p.dlse = static_cast<const float*>(base(7));
  p.dq_accum = static_cast<float*>(base(11));
  p.delta = static_cast<float*>(base(12));
  p.dq_semaphore = deterministic ? static_cast<int*>(base(13)) : nullptr;
  p.mask.segments = {static_cast<const int32_t*>(base(14)), static_cast<const int32_t*>(base(15)),
                     static_cast<const SegmentBlock*>(base(16)),
                     static_cast<const SegmentBlock*>(base(17)),
                     static_cast<const int32_t*>(base(18)), static_cast<const int32_t*>(base(19)),
                     seq_q, seq_k};
  dense(seq_q, heads, head_dim, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  dense(seq_k, heads_kv, head_dim, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  dense(seq_k, heads_kv, head_dim, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  dense(seq_q, heads, head_dim, p.out_batch_stride, p.out_row_stride, p.out_head_stride);
  dense(seq_q, heads, head_dim, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride);
  dense(seq_q, heads, head_dim, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  dense(seq_k, heads_kv, head_dim, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  dense(seq_k, heads_kv, head_dim, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  p.batch = batch, p.seqlen_q = seq_q, p.seqlen_k = seq_k;
  p.num_heads = heads, p.num_heads_kv = heads_kv, p.head_dim = head_dim;
  p.heads_per_kv = heads / heads_kv;
  // dq_accum as params_from_ffi.h lays it out: the kernels' dense [batch,
  // heads, seq_q, head_dim], or a caller's [batch, rows, heads, head_dim] with
  // more rows than this call's (jflash/params.h, DqMode).
  if (caller_accum) {
    p.dq_mode = DqMode::kAddToAccum;
    p.dq_accum_row_stride = int64_t{heads} * head_dim;
    p.dq_accum_head_stride = head_dim;
    p.dq_accum_batch_stride = int64_t{seq_q + 5} * heads * head_dim;
  } else {
    p.dq_accum_row_stride = head_dim;
    p.dq_accum_head_stride = int64_t{seq_q} * head_dim;
    p.dq_accum_batch_stride = int64_t{heads} * seq_q * head_dim;
  }
  return p;
}

// The segment ids and block summaries that a SegmentMask of batch entry bl of
// a chunk reads (jflash/mask.h) are those of entry b of the call.
void check_segments(const SegmentParams& chunk, const SegmentParams& call, int64_t bl, int64_t b) {
  CHECK(chunk.q_ids + bl * chunk.seqlen_q == call.q_ids + b * call.seqlen_q);
  CHECK(chunk.kv_ids + bl * chunk.seqlen_k == call.kv_ids + b * call.seqlen_k);
  CHECK(chunk.q_blocks + bl * segment_blocks(chunk.seqlen_q) ==
        call.q_blocks + b * segment_blocks(call.seqlen_q));
  CHECK(chunk.kv_blocks + bl * segment_blocks(chunk.seqlen_k) ==
        call.kv_blocks + b * segment_blocks(call.seqlen_k));
  CHECK(chunk.q_ranges + bl * chunk.seqlen_q * 2 == call.q_ranges + b * call.seqlen_q * 2);
  CHECK(chunk.kv_ranges + bl * chunk.seqlen_k * 2 == call.kv_ranges + b * call.seqlen_k * 2);
}

// Every (batch, head) of the forward and every (batch, kv head) of the
// backward, with the addresses each kernel computes.
void check_call(int batch, int heads, int heads_kv, int seq_q, int seq_k, int head_dim,
                bool deterministic, bool caller_accum = false) {
  const BwdParams p =
      make_params(batch, heads, heads_kv, seq_q, seq_k, head_dim, deterministic, caller_accum);
  const int group = p.heads_per_kv;

  // Forward: chunks of query heads; kv head = head / heads_per_kv.
  std::vector<uint8_t> seen(size_t(batch) * heads, 0);
  int64_t next = 0;  // one launch's order: heads fastest, then batches
  int fwd_launches = 0;
  for_each_grid_chunk(heads, batch, group, [&](const GridChunk& c) {
    ++fwd_launches;
    CHECK(c.heads >= 1 && c.heads <= 65535 && c.batches >= 1 && c.batches <= 65535);
    const FwdParams f = fwd_params_chunk(p, c);
    for (int64_t bl = 0; bl < c.batches; ++bl) {
      for (int64_t hl = 0; hl < c.heads; ++hl) {  // blockIdx.z, blockIdx.y
        const int64_t b = c.batch0 + bl, h = c.head0 + hl, kv = h / group;
        const int64_t kvl = hl / f.heads_per_kv;
        CHECK(!seen[b * heads + h]);
        seen[b * heads + h] = 1;
        if (heads <= 65535) CHECK(b * heads + h == next++);
        CHECK(at(f.q, bl * f.q_batch_stride + hl * f.q_head_stride) ==
              at(p.q, b * p.q_batch_stride + h * p.q_head_stride));
        CHECK(at(f.k, bl * f.k_batch_stride + kvl * f.k_head_stride) ==
              at(p.k, b * p.k_batch_stride + kv * p.k_head_stride));
        CHECK(at(f.v, bl * f.v_batch_stride + kvl * f.v_head_stride) ==
              at(p.v, b * p.v_batch_stride + kv * p.v_head_stride));
        CHECK(at(f.out, bl * f.out_batch_stride + hl * f.out_head_stride) ==
              at(p.out, b * p.out_batch_stride + h * p.out_head_stride));
        CHECK(f.lse + (bl * f.num_heads + hl) * f.seqlen_q ==
              p.lse + (b * p.num_heads + h) * p.seqlen_q);
        check_segments(f.mask.segments, p.mask.segments, bl, b);
      }
    }
    return cudaSuccess;
  });
  for (uint8_t s : seen) CHECK(s);

  // Backward: chunks of kv heads; a CTA walks the query heads of its group.
  std::vector<uint8_t> seen_kv(size_t(batch) * heads_kv, 0);
  int bwd_launches = 0;
  for_each_grid_chunk(heads_kv, batch, 1, [&](const GridChunk& c) {
    ++bwd_launches;
    CHECK(c.heads >= 1 && c.heads <= 65535 && c.batches >= 1 && c.batches <= 65535);
    const BwdParams q = bwd_params_chunk(p, c);
    for (int64_t bl = 0; bl < c.batches; ++bl) {
      for (int64_t kvl = 0; kvl < c.heads; ++kvl) {
        const int64_t b = c.batch0 + bl, kv = c.head0 + kvl;
        CHECK(!seen_kv[b * heads_kv + kv]);
        seen_kv[b * heads_kv + kv] = 1;
        CHECK(at(q.k, bl * q.k_batch_stride + kvl * q.k_head_stride) ==
              at(p.k, b * p.k_batch_stride + kv * p.k_head_stride));
        CHECK(at(q.v, bl * q.v_batch_stride + kvl * q.v_head_stride) ==
              at(p.v, b * p.v_batch_stride + kv * p.v_head_stride));
        CHECK(at(q.dk, bl * q.dk_batch_stride + kvl * q.dk_head_stride) ==
              at(p.dk, b * p.dk_batch_stride + kv * p.dk_head_stride));
        CHECK(at(q.dv, bl * q.dv_batch_stride + kvl * q.dv_head_stride) ==
              at(p.dv, b * p.dv_batch_stride + kv * p.dv_head_stride));
        check_segments(q.mask.segments, p.mask.segments, bl, b);
        for (int i : {0, 1, group - 1}) {  // query heads of the group (KeyBlockSteps)
          if (i >= group) continue;
          const int64_t hl = kvl * q.heads_per_kv + i, h = kv * group + i;
          CHECK(at(q.q, bl * q.q_batch_stride + hl * q.q_head_stride) ==
                at(p.q, b * p.q_batch_stride + h * p.q_head_stride));
          CHECK(at(q.dout, bl * q.dout_batch_stride + hl * q.dout_head_stride) ==
                at(p.dout, b * p.dout_batch_stride + h * p.dout_head_stride));
          CHECK(at(q.dq, bl * q.dq_batch_stride + hl * q.dq_head_stride) ==
                at(p.dq, b * p.dq_batch_stride + h * p.dq_head_stride));
          const int64_t local = (bl * q.num_heads + hl) * q.seqlen_q;
          const int64_t global = (b * p.num_heads + h) * p.seqlen_q;
          CHECK(q.lse + local == p.lse + global);
          CHECK(q.dlse + local == p.dlse + global);
          CHECK(q.delta + local == p.delta + global);
          CHECK(q.dq_accum + bl * q.dq_accum_batch_stride + hl * q.dq_accum_head_stride ==
                p.dq_accum + b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride);
          if (deterministic) {
            CHECK(q.dq_semaphore + (bl * q.num_heads + hl) * dq_semaphore_slots(q.seqlen_q) ==
                  p.dq_semaphore + (b * p.num_heads + h) * dq_semaphore_slots(p.seqlen_q));
          } else {
            CHECK(q.dq_semaphore == nullptr);
          }
        }
      }
    }
    return cudaSuccess;
  });
  for (uint8_t s : seen_kv) CHECK(s);
  std::printf("batch %d, heads %d / %d: %d forward launches, %d backward launches\n", batch,
              heads, heads_kv, fwd_launches, bwd_launches);
}

// The chunk bounds alone (no walk over the pairs), for counts near INT32_MAX:
// chunks tile heads x batch in order, and a head chunk holds whole groups or
// lies inside one.
void check_bounds(int heads, int batch, int group) {
  int64_t next_batch = 0, next_head = 0, launches = 0;
  bool ok = true;
  for_each_grid_chunk(heads, batch, group, [&](const GridChunk& c) {
    ++launches;
    ok &= c.heads >= 1 && c.heads <= 65535 && c.batches >= 1 && c.batches <= 65535;
    ok &= c.batch0 == next_batch && c.head0 == next_head;
    const int64_t first = c.head0, last = first + c.heads - 1;
    ok &= first / group == last / group || (first % group == 0 && c.heads % group == 0);
    next_head = last + 1;
    if (next_head == heads) next_head = 0, next_batch = int64_t{c.batch0} + c.batches;
    return cudaSuccess;
  });
  ok &= next_batch == batch && next_head == 0;
  CHECK(ok);
  std::printf("bounds: heads %d, batch %d, group %d: %lld launches\n", heads, batch, group,
              static_cast<long long>(launches));
}

}  // namespace

int main() {
  check_call(1, 1, 1, 4, 4, 32, false);
  check_call(3, 8, 2, 100, 70, 128, true);  // one chunk: the params unchanged
  check_call(70000, 1, 1, 4, 4, 32, false);
  check_call(70000, 2, 1, 4, 4, 32, true);
  check_call(70000, 2, 1, 4, 4, 32, false, /*caller_accum=*/true);
  check_call(131071, 3, 3, 4, 4, 64, false);
  check_call(1, 66000, 1, 129, 5, 32, false);    // MQA: a group of 66000 in two parts
  check_call(2, 66000, 33000, 3, 5, 32, true);   // groups of 2: chunks of 65534 and 466
  check_call(2, 66000, 33000, 3, 5, 32, false, /*caller_accum=*/true);
  check_call(1, 70000, 70000, 4, 4, 32, true);   // kv head chunks
  check_call(3, 70000, 7, 4, 4, 32, false);      // groups of 10000
  check_call(2, 200000, 2, 4, 4, 32, false);     // groups of 100000
  check_call(1, 131071, 1, 4, 4, 32, false);     // three parts of 43691 / 43690
  check_call(2, 65535 * 2, 2, 4, 4, 32, false);  // groups of exactly 65535
  check_call(1, 65536 * 2, 2, 4, 4, 32, false);  // groups of 65536
  check_call(2, 65537, 65537, 4, 4, 32, false);
  check_bounds(1, 2147483647, 1);
  check_bounds(2147483647, 1, 1);
  check_bounds(2147483647, 1, 2147483647);
  check_bounds(2147483646, 1, 1073741823);
  check_bounds(65535 * 3, 5, 65535);
  check_bounds(3 * 7 * 65536, 2, 7 * 65536);
  return host_check::report();
}
