// The C++ CPU twin of the GPU kernels: same tiling, same online softmax, same
// backward recomputation, float32 accumulation for every input dtype.
#pragma once

#include "jflash/params.h"

namespace jflash::cpu {

// out, lse <- attention(q, k, v). Extra memory is O(block) per worker, never
// O(seqlen_q * seqlen_k). Parallel over (batch, head, query block) on the
// library's own worker pool; returns when every output is written. mask: the
// policy that reads params.mask (the handler's params.mask.kind(...)).
void flash_fwd(const FwdParams& params, MaskKind mask);

// dq, dk, dv <- backward of flash_fwd, recomputing P from lse. Uses params.delta
// as float32 scratch (or reads the caller's); dq goes where params.dq_mode says:
// dq, or the caller's float32 dq_accum (null, unused, with DqMode::kWrite); dk,
// dv where params.dkv_mode says. GQA gradients are summed into the kv head
// inside the kernel.
void flash_bwd(const BwdParams& params, MaskKind mask);

// out, lse <- decode attention over a KV cache (params.h, DecodeParams), after
// writing k_new, v_new into the cache; with num_splits > 1 through
// out_partial and lse_partial, combined by lse.
void flash_decode(const DecodeParams& params);

// Rows of one decode task (a kv head's query heads times the queries): the
// num_splits heuristic's unit.
int decode_row_block();
// Keys of one decode tile: the unit in which a split's run is cut.
int decode_key_block();

}  // namespace jflash::cpu
