// XLA FFI buffers and attributes -> jflash::FwdParams / BwdParams.
//
// Shared by the CPU and CUDA handlers so both platforms validate identically.
// Python (jflash/_src/) already validates every user-facing argument at trace
// time; the checks here guard the ABI (a stale or hand-written custom call) and
// return ffi::Error, never throw or abort.
//
// Leading dimensions are folded into batch: q may be [..., seqlen_q, num_heads,
// head_dim]. jax.vmap of the ffi_call (vmap_method="broadcast_all") adds such
// axes, and folding them runs the whole vmapped batch in one launch.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "jflash/head_dims.h"
#include "jflash/params.h"
#include "xla/ffi/api/ffi.h"

namespace jflash::ffi_glue {

namespace ffi = xla::ffi;

constexpr int kMaxHeadDim = kMaxKernelHeadDim;

inline std::string DimsToString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

inline ffi::ErrorOr<DType> ToDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return DType::kFloat16;
    case ffi::DataType::BF16: return DType::kBFloat16;
    case ffi::DataType::F32: return DType::kFloat32;
    default: return ffi::Error::InvalidArgument("jflash: unsupported dtype");
  }
}

// [lead..., seq, heads, head_dim] -> (batch = prod(lead), seq, heads, head_dim).
struct Shape4 {
  int64_t batch, seq, heads, head_dim;
};

inline ffi::ErrorOr<Shape4> FoldShape(ffi::AnyBuffer::Dimensions dims, const char* name) {
  if (dims.size() < 4) {
    return ffi::Error::InvalidArgument(std::string("jflash: ") + name +
                                       " must have rank >= 4, got " + DimsToString(dims));
  }
  Shape4 s{1, dims[dims.size() - 3], dims[dims.size() - 2], dims[dims.size() - 1]};
  for (size_t i = 0; i + 3 < dims.size(); ++i) s.batch *= dims[i];
  return s;
}

// Dense [batch, seq, heads, head_dim] strides, in elements.
inline void DenseStrides(const Shape4& s, int64_t* batch_stride, int64_t* row_stride,
                         int64_t* head_stride) {
  *head_stride = s.head_dim;
  *row_stride = s.heads * s.head_dim;
  *batch_stride = s.seq * s.heads * s.head_dim;
}

inline bool SameShape(const Shape4& a, const Shape4& b) {
  return a.batch == b.batch && a.seq == b.seq && a.heads == b.heads && a.head_dim == b.head_dim;
}

// The segment-id buffers of a call: all six empty (no segment ids), or the
// ids, their block summaries, each row's keys and each key's rows
// (jflash/mask.h, SegmentParams), int32.
struct SegmentBuffers {
  ffi::AnyBuffer q_ids, kv_ids, q_blocks, kv_blocks, q_ranges, kv_ranges;
};

inline ffi::Error FillSegmentParams(const SegmentBuffers& b, const FwdParams& p,
                                    SegmentParams* s) {
  *s = SegmentParams{};
  const ffi::AnyBuffer* buffers[] = {&b.q_ids,    &b.kv_ids,   &b.q_blocks,
                                     &b.kv_blocks, &b.q_ranges, &b.kv_ranges};
  int64_t nonempty = 0;
  for (const ffi::AnyBuffer* x : buffers) {
    if (x->element_type() != ffi::DataType::S32) {
      return ffi::Error::InvalidArgument("jflash: segment ids and their blocks must be int32");
    }
    nonempty += x->element_count() > 0;
  }
  if (nonempty == 0) return ffi::Error::Success();
  const int64_t batch = p.batch;
  if (b.q_ids.element_count() != batch * p.seqlen_q ||
      b.kv_ids.element_count() != batch * p.seqlen_k ||
      b.q_blocks.element_count() != batch * segment_blocks(p.seqlen_q) * 4 ||
      b.kv_blocks.element_count() != batch * segment_blocks(p.seqlen_k) * 4 ||
      b.q_ranges.element_count() != batch * p.seqlen_q * 2 ||
      b.kv_ranges.element_count() != batch * p.seqlen_k * 2) {
    return ffi::Error::InvalidArgument(
        "jflash: segment ids must be [batch, seqlen] (q and kv) with their block summaries "
        "[batch, ceil(seqlen / " + std::to_string(kSegmentBlock) + "), 4] and ranges "
        "[batch, seqlen, 2]");
  }
  for (const ffi::AnyBuffer* x : {&b.q_blocks, &b.kv_blocks}) {
    if (reinterpret_cast<uintptr_t>(x->untyped_data()) % alignof(SegmentBlock) != 0) {
      return ffi::Error::InvalidArgument("jflash: segment blocks must be 16-byte aligned");
    }
  }
  s->q_ids = static_cast<const int32_t*>(b.q_ids.untyped_data());
  s->kv_ids = static_cast<const int32_t*>(b.kv_ids.untyped_data());
  s->q_blocks = static_cast<const SegmentBlock*>(b.q_blocks.untyped_data());
  s->kv_blocks = static_cast<const SegmentBlock*>(b.kv_blocks.untyped_data());
  s->q_ranges = static_cast<const int32_t*>(b.q_ranges.untyped_data());
  s->kv_ranges = static_cast<const int32_t*>(b.kv_ranges.untyped_data());
  s->seqlen_q = p.seqlen_q;
  s->seqlen_k = p.seqlen_k;
  return ffi::Error::Success();
}

// The float32 kernels' passes (jflash/params.h, tf32_passes), checked for every
// dtype and platform so that a bad attribute never depends on where it runs.
inline ffi::Error SetTf32Passes(int64_t passes, FwdParams* p) {
  if (passes != 1 && passes != 3) {
    return ffi::Error::InvalidArgument("jflash: tf32_passes must be 1 or 3, got " +
                                       std::to_string(passes));
  }
  p->tf32_passes = static_cast<int>(passes);
  return ffi::Error::Success();
}

// The Hopper forward's schedule counter under segment ids (jflash/params.h,
// tile_counter): int32, at least one element where the call has segment ids
// (null where it is empty).
inline ffi::Error SetTileCounter(ffi::AnyBuffer counter, FwdParams* p) {
  if (counter.element_count() == 0) {
    p->tile_counter = nullptr;
  } else if (counter.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument("jflash: tile_counter must be int32");
  } else {
    p->tile_counter = static_cast<int*>(counter.untyped_data());
  }
  if (p->mask.segments.q_ids != nullptr && p->tile_counter == nullptr) {
    return ffi::Error::InvalidArgument(
        "jflash: a forward call with segment ids needs its int32 tile_counter scratch");
  }
  return ffi::Error::Success();
}

inline ffi::Error FillFwdParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                const SegmentBuffers& segments, ffi::AnyBuffer out,
                                ffi::AnyBuffer lse, float softmax_scale, int64_t diag_lo,
                                int64_t diag_hi, float softcap, FwdParams* p) {
  auto dtype = ToDType(q.element_type());
  if (dtype.has_error()) return dtype.error();
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      out.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("jflash: q, k, v and out must share one dtype");
  }
  if (lse.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("jflash: lse must be float32");
  }
  auto qs = FoldShape(q.dimensions(), "q");
  if (qs.has_error()) return qs.error();
  auto ks = FoldShape(k.dimensions(), "k");
  if (ks.has_error()) return ks.error();
  auto vs = FoldShape(v.dimensions(), "v");
  if (vs.has_error()) return vs.error();
  auto os = FoldShape(out.dimensions(), "out");
  if (os.has_error()) return os.error();
  if (!SameShape(*ks, *vs) || !SameShape(*qs, *os) || ks->batch != qs->batch ||
      ks->head_dim != qs->head_dim) {
    return ffi::Error::InvalidArgument("jflash: inconsistent shapes q " +
                                       DimsToString(q.dimensions()) + ", k " +
                                       DimsToString(k.dimensions()) + ", v " +
                                       DimsToString(v.dimensions()));
  }
  if (qs->head_dim < 1 || qs->head_dim > kMaxHeadDim || ks->heads < 1 ||
      qs->heads % ks->heads != 0) {
    return ffi::Error::InvalidArgument("jflash: unsupported head_dim or head counts");
  }
  // The params hold these as int; past INT32_MAX they would wrap, and the
  // kernels would run on a wrong shape. (batch folds the leading axes, a vmap's
  // among them.)
  for (int64_t n : {qs->batch, qs->seq, ks->seq, qs->heads}) {
    if (n > INT32_MAX) {
      return ffi::Error::InvalidArgument(
          "jflash: batch (the product of the leading axes), sequence lengths and head counts "
          "must each be below 2^31; got q " + DimsToString(q.dimensions()) + ", k " +
          DimsToString(k.dimensions()));
    }
  }
  if (lse.element_count() != qs->batch * qs->heads * qs->seq) {
    return ffi::Error::InvalidArgument("jflash: lse must hold batch * num_heads * seqlen_q floats");
  }
  if (!std::isfinite(softmax_scale)) {
    return ffi::Error::InvalidArgument("jflash: softmax_scale must be finite");
  }
  constexpr float kLog2e = 1.4426950408889634f;
  // softcap: 0 (none) or > 0, with finite factors on both sides of the tanh
  // (jflash/score.h; jflash/_src/validation.py checks the same).
  const float softcap_scale = softcap > 0.f ? softmax_scale / softcap : 0.f;
  if (!(softcap >= 0.f) || !std::isfinite(softcap * kLog2e) || !std::isfinite(softcap_scale)) {
    return ffi::Error::InvalidArgument(
        "jflash: softcap must be 0 (none) or > 0, with softcap * log2(e) and softmax_scale / "
        "softcap finite; got " + std::to_string(softcap));
  }

  p->dtype = *dtype;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->out = out.untyped_data();
  p->lse = static_cast<float*>(lse.untyped_data());
  DenseStrides(*qs, &p->q_batch_stride, &p->q_row_stride, &p->q_head_stride);
  DenseStrides(*ks, &p->k_batch_stride, &p->k_row_stride, &p->k_head_stride);
  DenseStrides(*vs, &p->v_batch_stride, &p->v_row_stride, &p->v_head_stride);
  DenseStrides(*os, &p->out_batch_stride, &p->out_row_stride, &p->out_head_stride);
  p->batch = static_cast<int>(qs->batch);
  p->seqlen_q = static_cast<int>(qs->seq);
  p->seqlen_k = static_cast<int>(ks->seq);
  p->num_heads = static_cast<int>(qs->heads);
  p->num_heads_kv = static_cast<int>(ks->heads);
  p->head_dim = static_cast<int>(qs->head_dim);
  p->heads_per_kv = p->num_heads / p->num_heads_kv;
  p->softmax_scale = softmax_scale;
  // With softcap the kernels' score is tanh(softcap_scale * q.k), which the
  // softmax takes times softcap.
  p->softmax_scale_log2 = (softcap > 0.f ? softcap : softmax_scale) * kLog2e;
  p->softcap = softcap;
  p->softcap_scale = softcap_scale;
  // Clamp here too so that kernels may rely on the documented range.
  auto clamp = [](int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); };
  p->mask.diag_lo = clamp(diag_lo, -qs->seq, ks->seq);
  p->mask.diag_hi = clamp(diag_hi, -qs->seq, ks->seq);
  return FillSegmentParams(segments, *p, &p->mask.segments);
}

inline ffi::Error FillBwdParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                                ffi::AnyBuffer dlse, const SegmentBuffers& segments,
                                ffi::AnyBuffer delta_in, ffi::AnyBuffer dq_accum_in,
                                ffi::AnyBuffer dkv_accum_in, ffi::AnyBuffer dq, ffi::AnyBuffer dk,
                                ffi::AnyBuffer dv, ffi::AnyBuffer dq_accum, ffi::AnyBuffer delta,
                                ffi::AnyBuffer dq_semaphore, ffi::AnyBuffer dkv_accum,
                                float softmax_scale, int64_t diag_lo, int64_t diag_hi,
                                float softcap, int64_t dq_mode, int64_t dq_accum_row_offset,
                                int64_t dkv_mode, BwdParams* p, bool uses_dq_accum = true) {
  if (auto err = FillFwdParams(q, k, v, segments, out, lse, softmax_scale, diag_lo, diag_hi,
                               softcap, p);
      err.failure()) {
    return err;
  }
  if (dq_mode < 0 || dq_mode > 2) {
    return ffi::Error::InvalidArgument("jflash: dq_mode must be 0, 1 or 2");
  }
  if (dkv_mode < 0 || dkv_mode > 1) {
    return ffi::Error::InvalidArgument("jflash: dkv_mode must be 0 or 1");
  }
  const DqMode mode = static_cast<DqMode>(dq_mode);
  const bool adds = mode == DqMode::kAddToAccum;
  const bool adds_dkv = static_cast<DkvMode>(dkv_mode) == DkvMode::kAddToAccum;
  const int64_t rows = int64_t{p->batch} * p->num_heads * p->seqlen_q;
  if (dout.element_type() != q.element_type() || dq.element_type() != q.element_type() ||
      dk.element_type() != q.element_type() || dv.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("jflash: dout, dq, dk, dv must have the dtype of q");
  }
  const int64_t dq_count = mode == DqMode::kWrite ? q.element_count() : 0;
  if (dout.element_count() != q.element_count() || dq.element_count() != dq_count ||
      dk.element_count() != (adds_dkv ? 0 : k.element_count()) ||
      dv.element_count() != (adds_dkv ? 0 : v.element_count())) {
    return ffi::Error::InvalidArgument("jflash: gradient shapes must match q, k, v");
  }
  // dq_accum, float32: the CUDA kernels' scratch [batch, num_heads, seqlen_q,
  // head_dim] with dq_mode 0, where a handler whose kernels do not use it
  // (uses_dq_accum false: the CPU one) takes an empty buffer; with 1 the
  // result [batch, seqlen_q, num_heads, head_dim]; with 2 the caller's
  // accumulator [batch, rows, num_heads, head_dim] (aliased to dq_accum_in),
  // of which this call's rows start at dq_accum_row_offset.
  const bool accum_used = uses_dq_accum || mode != DqMode::kWrite;
  const int64_t row_elems = int64_t{p->batch} * p->num_heads * p->head_dim;
  int64_t accum_rows = p->seqlen_q;
  if (adds && row_elems > 0) {
    if (dq_accum.element_count() % row_elems != 0) {
      return ffi::Error::InvalidArgument("jflash: bad dq_accum buffer");
    }
    accum_rows = dq_accum.element_count() / row_elems;
  }
  if (dq_accum_row_offset < 0 || (!adds && dq_accum_row_offset != 0) ||
      dq_accum_row_offset > accum_rows - p->seqlen_q) {
    return ffi::Error::InvalidArgument(
        "jflash: dq_accum_row_offset must leave seqlen_q rows of dq_accum (0 unless dq_mode 2)");
  }
  const bool dq_accum_ok = dq_accum.element_count() == accum_rows * row_elems ||
                           (!accum_used && dq_accum.element_count() == 0);
  if (dlse.element_type() != ffi::DataType::F32 || dlse.element_count() != rows ||
      delta.element_type() != ffi::DataType::F32 || delta.element_count() != (adds ? 0 : rows) ||
      dq_accum.element_type() != ffi::DataType::F32 || !dq_accum_ok) {
    return ffi::Error::InvalidArgument("jflash: bad dlse, delta or dq_accum buffer");
  }
  // With dq_mode 2 the caller passes its delta and its accumulator, which XLA
  // aliases to the dq_accum result (input_output_aliases): the same memory.
  if (delta_in.element_type() != ffi::DataType::F32 ||
      delta_in.element_count() != (adds ? rows : 0) ||
      dq_accum_in.element_type() != ffi::DataType::F32 ||
      dq_accum_in.element_count() != (adds ? dq_accum.element_count() : 0) ||
      (adds && dq_accum_in.untyped_data() != dq_accum.untyped_data() &&
       dq_accum.element_count() > 0)) {
    return ffi::Error::InvalidArgument(
        "jflash: dq_mode 2 takes delta_in and dq_accum_in (aliased to dq_accum); other modes "
        "neither");
  }
  // dq_semaphore: empty (dQ additions in any order) or one int32 counter per
  // slot of params.h's dq_semaphore_slots (deterministic mode).
  if (dq_semaphore.element_type() != ffi::DataType::S32 ||
      (dq_semaphore.element_count() != 0 &&
       dq_semaphore.element_count() != dq_semaphore_count(*p))) {
    return ffi::Error::InvalidArgument("jflash: bad dq_semaphore buffer");
  }
  // dkv_accum, float32: with dkv_mode 0 empty or the CUDA kernels' scratch
  // for GQA [batch, num_heads_kv, 2, seqlen_k, head_dim]; with 1 the caller's
  // sums [batch, 2, rows, num_heads_kv, head_dim] (rows >= seqlen_k; this
  // call's keys are the first seqlen_k), aliased to dkv_accum_in.
  const int64_t kv_row_elems = int64_t{p->num_heads_kv} * p->head_dim;
  int64_t dkv_rows = p->seqlen_k;
  if (adds_dkv && p->batch > 0 && kv_row_elems > 0) {
    if (dkv_accum.element_count() % (2 * p->batch * kv_row_elems) != 0) {
      return ffi::Error::InvalidArgument("jflash: bad dkv_accum buffer");
    }
    dkv_rows = dkv_accum.element_count() / (2 * p->batch * kv_row_elems);
  }
  const bool dkv_accum_ok =
      adds_dkv ? dkv_rows >= p->seqlen_k &&
                     dkv_accum.element_count() == 2 * p->batch * dkv_rows * kv_row_elems
               : dkv_accum.element_count() == 0 ||
                     (p->heads_per_kv > 1 && dkv_accum.element_count() == dkv_accum_count(*p));
  if (dkv_accum.element_type() != ffi::DataType::F32 || !dkv_accum_ok) {
    return ffi::Error::InvalidArgument("jflash: bad dkv_accum buffer");
  }
  if (dkv_accum_in.element_type() != ffi::DataType::F32 ||
      dkv_accum_in.element_count() != (adds_dkv ? dkv_accum.element_count() : 0) ||
      (adds_dkv && dkv_accum_in.untyped_data() != dkv_accum.untyped_data() &&
       dkv_accum.element_count() > 0)) {
    return ffi::Error::InvalidArgument(
        "jflash: dkv_mode 1 takes dkv_accum_in (aliased to dkv_accum); dkv_mode 0 does not");
  }
  p->dout = dout.untyped_data();
  p->dlse = static_cast<const float*>(dlse.untyped_data());
  p->dq = dq.untyped_data();
  p->dk = dk.untyped_data();
  p->dv = dv.untyped_data();
  p->dq_mode = mode;
  const int64_t d = p->head_dim;
  if (mode == DqMode::kWrite) {
    p->dq_accum_row_stride = d;
    p->dq_accum_head_stride = p->seqlen_q * d;
    p->dq_accum_batch_stride = p->num_heads * p->seqlen_q * d;
  } else {
    p->dq_accum_row_stride = p->num_heads * d;
    p->dq_accum_head_stride = d;
    p->dq_accum_batch_stride = accum_rows * p->num_heads * d;
  }
  p->dq_accum = accum_used ? static_cast<float*>(dq_accum.untyped_data()) +
                                 dq_accum_row_offset * p->dq_accum_row_stride
                           : nullptr;
  p->delta = static_cast<float*>(adds ? delta_in.untyped_data() : delta.untyped_data());
  p->dq_semaphore = uses_dq_accum && dq_semaphore.element_count() > 0
                        ? static_cast<int*>(dq_semaphore.untyped_data())
                        : nullptr;
  p->dkv_mode = static_cast<DkvMode>(dkv_mode);
  p->dkv_accum = (uses_dq_accum || adds_dkv) && dkv_accum.element_count() > 0
                     ? static_cast<float*>(dkv_accum.untyped_data())
                     : nullptr;
  if (adds_dkv) {
    p->dkv_accum_head_stride = d;
    p->dkv_accum_row_stride = kv_row_elems;
    p->dkv_accum_plane_stride = dkv_rows * kv_row_elems;
    p->dkv_accum_batch_stride = 2 * dkv_rows * kv_row_elems;
  } else {
    p->dkv_accum_row_stride = d;
    p->dkv_accum_plane_stride = p->seqlen_k * d;
    p->dkv_accum_head_stride = 2 * p->seqlen_k * d;
    p->dkv_accum_batch_stride = p->num_heads_kv * 2 * p->seqlen_k * d;
  }
  p->head_splits = 1;
  p->launch_group = 1;
  p->dout_batch_stride = p->out_batch_stride;
  p->dout_row_stride = p->out_row_stride;
  p->dout_head_stride = p->out_head_stride;
  p->dq_batch_stride = p->q_batch_stride;
  p->dq_row_stride = p->q_row_stride;
  p->dq_head_stride = p->q_head_stride;
  p->dk_batch_stride = p->k_batch_stride;
  p->dk_row_stride = p->k_row_stride;
  p->dk_head_stride = p->k_head_stride;
  p->dv_batch_stride = p->v_batch_stride;
  p->dv_row_stride = p->v_row_stride;
  p->dv_head_stride = p->v_head_stride;
  return ffi::Error::Success();
}

}  // namespace jflash::ffi_glue
