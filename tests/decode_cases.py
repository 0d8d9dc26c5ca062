"""Decode cases (flash_attention_with_kvcache) and their float64 truth, shared by
test_decode.py and test_decode_cuda.py.

The truth is built here from the documented rules alone: each sequence's keys
are its first cache_len cache positions (cache_seqlens clamped to [0, capacity
- seq_new]), found through the block table (ids clamped to the cache's
blocks), then the new keys; the band is causal and the window aligned to that
length (checks.window_diags); reference64 computes the attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jflash
import reference64
from checks import assert_within_rule, plain_dtype, window_diags
from jflash._src.decode import resolve_kvcache_arguments
from jflash.reference import kvcache_attention


@dataclasses.dataclass(frozen=True)
class Case:
    seqlens: tuple  # cache_seqlens, one per sequence (out-of-range values are clamped)
    capacity: int  # keys per sequence (paged: max_blocks_per_seq * block_size)
    seq_q: int = 1
    heads: int = 8
    heads_kv: int = 2
    head_dim: int = 128
    block_size: int | None = None  # None: a contiguous cache
    seq_new: int = 0  # 0: no append
    causal: bool = True
    window: tuple | None = None
    softcap: float | None = None
    num_splits: int | None = None
    dtype: str = "bfloat16"
    # Block-table entries of sequence 0's first block replaced by an id outside
    # the cache (clamped by the kernels): -1 or num_blocks + 5.
    bad_block_id: int | None = None

    @property
    def batch(self):
        return len(self.seqlens)

    def id(self):
        layout = "contig" if self.block_size is None else f"paged{self.block_size}"
        parts = [layout, f"q{self.seq_q}", f"h{self.heads}/{self.heads_kv}", f"d{self.head_dim}",
                 f"new{self.seq_new}", "causal" if self.causal else "full"]
        parts += [f"w{self.window}"] if self.window else []
        parts += [f"cap{self.softcap}"] if self.softcap else []
        parts += [f"splits{self.num_splits}"] if self.num_splits else []
        parts += [self.dtype]
        parts += [f"badblock{self.bad_block_id}"] if self.bad_block_id is not None else []
        return "-".join(parts).replace(" ", "")


def make_inputs(rng, case: Case, nan_past_end=False):
    """Arrays of a case as a dict of jnp arrays (block_table None when
    contiguous). nan_past_end: every cache position past a sequence's clamped
    length (where its new keys go, and beyond) holds NaN, which no result may see."""
    dtype = jnp.dtype(case.dtype)
    b, d, hk = case.batch, case.head_dim, case.heads_kv
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    inputs = {"query": normal(b, case.seq_q, case.heads, d)}
    if case.block_size is None:
        cache_shape = (b, case.capacity, hk, d)
        table = None
    else:
        blocks_per_seq = case.capacity // case.block_size
        num_blocks = b * blocks_per_seq + 2  # two spare blocks: ids 0 and the last one
        cache_shape = (num_blocks, case.block_size, hk, d)
        table = (1 + rng.permutation(num_blocks - 2)).reshape(b, blocks_per_seq)
        if case.bad_block_id is not None:
            table[0, 0] = case.bad_block_id
    inputs["k_cache"], inputs["v_cache"] = normal(*cache_shape), normal(*cache_shape)
    if nan_past_end:
        for name in ("k_cache", "v_cache"):
            for s in range(b):
                for pos in range(cache_len(case, s), case.capacity):
                    block, row = slot(case, table, s, pos)
                    inputs[name][block, row] = np.nan
    if case.seq_new:
        inputs["k_new"] = normal(b, case.seq_new, hk, d)
        inputs["v_new"] = normal(b, case.seq_new, hk, d)
    arrays = {k: jnp.asarray(v, dtype) for k, v in inputs.items()}
    arrays["cache_seqlens"] = jnp.asarray(case.seqlens, jnp.int32)
    arrays["block_table"] = None if table is None else jnp.asarray(table, jnp.int32)
    return arrays


def cache_len(case, s):
    return int(np.clip(case.seqlens[s], 0, case.capacity - case.seq_new))


def slot(case, table, s, position):
    """(block, row) of a sequence's position, block ids clamped."""
    if table is None:
        return s, position
    num_blocks = case.batch * (case.capacity // case.block_size) + 2
    block = int(np.clip(table[s, position // case.block_size], 0, num_blocks - 1))
    return block, position % case.block_size


def kwargs(case: Case, arrays, **extra):
    names = ("cache_seqlens", "k_new", "v_new", "block_table")
    kw = {k: arrays.get(k) for k in names}
    kw.update(causal=case.causal, window_size=case.window, softcap=case.softcap,
              num_splits=case.num_splits, return_lse=True)
    kw.update(extra)
    return kw


def truth(case: Case, arrays):
    """(out [b, sq, h, d], lse [b, h, sq], k_cache, v_cache) in float64 / numpy."""
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    q, kc, vc = f64(arrays["query"]), f64(arrays["k_cache"]), f64(arrays["v_cache"])
    table = None if arrays["block_table"] is None else np.asarray(arrays["block_table"])
    kn = f64(arrays["k_new"]) if case.seq_new else None
    vn = f64(arrays["v_new"]) if case.seq_new else None
    scale = 1 / np.sqrt(case.head_dim)
    out = np.zeros(q.shape)
    lse = np.full((case.batch, case.heads, case.seq_q), -np.inf)
    k_cache, v_cache = kc.copy(), vc.copy()
    for s in range(case.batch):
        n = cache_len(case, s)
        slots = [slot(case, table, s, p) for p in range(n)]
        keys = np.stack([kc[blk, row] for blk, row in slots] or [np.zeros(kc.shape[2:])])[:n]
        values = np.stack([vc[blk, row] for blk, row in slots] or [np.zeros(vc.shape[2:])])[:n]
        if case.seq_new:
            keys, values = np.concatenate([keys, kn[s]]), np.concatenate([values, vn[s]])
            for t in range(case.seq_new):
                blk, row = slot(case, table, s, n + t)
                k_cache[blk, row], v_cache[blk, row] = kn[s, t], vn[s, t]
        total = len(keys)
        if total == 0:
            continue  # no key at all: out 0, lse -inf
        lo, hi = window_diags(case.seq_q, total, case.causal, case.window or (-1, -1))
        o, l, _ = reference64.forward(q[s:s + 1], keys[None], values[None], scale, lo, hi,
                                      softcap=case.softcap)
        out[s], lse[s] = o[0], l[0]
    return out, lse, k_cache, v_cache


def plain(case: Case, arrays):
    """The same computation in plain jnp in the kernel's dtype (jflash.reference):
    the yardstick of FlashAttention's 2x rule."""
    kw = kwargs(case, arrays)
    args = resolve_kvcache_arguments(arrays["query"], arrays["k_cache"], arrays["v_cache"],
                                     kw["cache_seqlens"], kw["k_new"], kw["v_new"],
                                     kw["block_table"], case.causal, case.window, case.softcap,
                                     None, True, case.num_splits)
    # The reference ignores num_splits: leaving it out of the static config lets
    # cases that differ only in it share one compiled program.
    out, lse, _, _ = _plain_jit(arrays["query"], arrays["k_cache"], arrays["v_cache"],
                                args.cache_seqlens, kw["k_new"], kw["v_new"], args.block_table,
                                config=args.config._replace(num_splits=None),
                                capacity=args.capacity, dtype=plain_dtype(jnp.dtype(case.dtype)))
    return out, lse


# One compiled program per shape: much faster than the reference's ops one by one.
_plain_jit = jax.jit(kvcache_attention, static_argnames=("config", "capacity", "dtype"))


def check_case(rng, case: Case, *, jit=True, nan_past_end=False):
    """Runs the kernel on a case and checks out and lse under the 2x rule, and the
    returned caches exactly. Returns the kernel's (out, lse)."""
    arrays = make_inputs(rng, case, nan_past_end)

    def call(query, k_cache, v_cache, **kw):
        return jflash.flash_attention_with_kvcache(query, k_cache, v_cache, **kw)

    fn = jax_jit(call) if jit else call
    results = fn(arrays["query"], arrays["k_cache"], arrays["v_cache"], **kwargs(case, arrays))
    out, lse = results[:2]
    dtype = jnp.dtype(case.dtype)
    assert out.shape == arrays["query"].shape and out.dtype == dtype
    assert lse.shape == (case.batch, case.heads, case.seq_q) and lse.dtype == jnp.float32
    true_out, true_lse, true_k, true_v = truth(case, arrays)
    plain_out, plain_lse = plain(case, arrays)
    assert_within_rule("out", out, plain_out, true_out, dtype)
    assert_within_rule("lse", lse, plain_lse, true_lse, dtype)
    if case.seq_new:
        k_cache, v_cache = results[2:]
        for name, got, want in (("k_cache", k_cache, true_k), ("v_cache", v_cache, true_v)):
            got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
            np.testing.assert_array_equal(got, want, err_msg=name)
    return out, lse


def jax_jit(fn):
    """fn(query, k_cache, v_cache, **kw) under jax.jit, its array keywords traced and
    the others static."""

    @functools.wraps(fn)
    def jitted(query, k_cache, v_cache, **kw):
        arrays = {k: v for k, v in kw.items() if v is not None and hasattr(v, "shape")}
        static = {k: v for k, v in kw.items() if k not in arrays}
        return jax.jit(lambda q, kc, vc, a: fn(q, kc, vc, **a, **static))(query, k_cache, v_cache,
                                                                            arrays)

    return jitted
