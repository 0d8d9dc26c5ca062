"""The precision argument: its parsing, its way to the kernels, and float32 accuracy.

precision follows jax's matmul convention (jflash.flash_attention's docstring):
DEFAULT and HIGH run float32 inputs on the TF32 CUDA kernels (the FFI attribute
tf32_passes = 1), HIGHEST on the 3xTF32 ones (tf32_passes = 3); None reads
jax_default_matmul_precision at trace time. The CPU kernels compute float32 in
float32 and the half-precision kernels have one precision, so on CPU the tests
check the parsing, the attribute in the lowered program, the head-dim padding of
float32 calls and that results do not change. On a GPU with the float32
kernels, the accuracy rule: with a float64 truth (reference64.py), jflash's max
|error| at each precision is at most twice that of XLA's attention
(jax.nn.dot_product_attention(implementation="xla")) at the same precision, plus
a small floor, for out and for dq, dk, dv.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
import reference64
from checks import float64_inputs, max_err, qkv_inputs, window_diags
from segments import packed_ids
from jflash._src import validation
from jflash._src.ffi import FLOAT32_HEAD_DIMS, cuda_forward_family

Precision = jax.lax.Precision

_ATTRIBUTE = re.compile(r"tf32_passes = (\d+) : i64")


def _tf32_passes_in(fn, *args):
    """The set of tf32_passes attributes of the jflash calls in fn's lowered program."""
    text = jax.jit(fn).lower(*args).as_text()
    assert "jflash_fwd" in text
    return {int(x) for x in _ATTRIBUTE.findall(text)}


def _inputs(rng, shape=(2, 37, 45, 4, 2, 64), dtype=jnp.float32):
    return qkv_inputs(rng, shape, dtype)


# ------------------------------------------------------------------ parsing

@pytest.mark.parametrize("precision, passes", [
    (None, 1),
    (Precision.DEFAULT, 1),
    (Precision.HIGH, 1),
    (Precision.HIGHEST, 3),
    ("default", 1),
    ("fastest", 1),
    ("bfloat16", 1),
    ("high", 1),
    ("tensorfloat32", 1),
    ("highest", 3),
    ("float32", 3),
    ((Precision.DEFAULT, Precision.HIGHEST), 3),
    (("highest", "default"), 3),
    (["high", Precision.DEFAULT], 1),
], ids=repr)
def test_precision_forms(precision, passes):
    assert validation.tf32_passes(precision) == passes


@pytest.mark.parametrize("setting, passes", [("highest", 3), ("float32", 3), ("high", 1),
                                             ("default", 1), ("tensorfloat32", 1)])
def test_default_is_the_config_at_trace_time(rng, setting, passes):
    q, k, v = _inputs(rng)
    fn = functools.partial(jflash.flash_attention, causal=True)
    assert _tf32_passes_in(fn, q, k, v) == {1}
    with jax.default_matmul_precision(setting):
        assert validation.tf32_passes(None) == passes
        assert _tf32_passes_in(fn, q, k, v) == {passes}
        # An explicit precision overrides the setting.
        explicit = functools.partial(fn, precision="default")
        assert _tf32_passes_in(explicit, q, k, v) == {1}


@pytest.mark.parametrize("bad", ["fast", "HIGHEST!", 1, 2.0, True, ("high",),
                                 ("high", "low"), (None, None), ("high", "high", "high"),
                                 Precision, jax.lax.DotAlgorithmPreset.F32_F32_F32, "F32_F32_F32"],
                         ids=repr)
def test_bad_precision_raises_at_trace_time(rng, bad):
    q, k, v = _inputs(rng, dtype=jnp.bfloat16)  # checked whatever the dtype
    message = re.escape(f"jflash: precision {bad!r}"[:40])
    with pytest.raises(ValueError, match=message):
        jflash.flash_attention(q, k, v, precision=bad)
    with pytest.raises(ValueError, match="accepts None"):
        jax.jit(functools.partial(jflash.flash_attention, precision=bad)).lower(q, k, v)


def test_unmappable_config_raises_at_trace_time(rng):
    """A DotAlgorithmPreset name as jax_default_matmul_precision has no jflash
    kernel: flash_attention raises, naming the setting; the jax.nn drop-in hands
    the call to jax's function (which takes it), or raises for "jflash"."""
    q, k, v = _inputs(rng)
    with jax.default_matmul_precision("F32_F32_F32"):
        with pytest.raises(ValueError, match="jax_default_matmul_precision 'F32_F32_F32'"):
            jax.jit(jflash.flash_attention).lower(q, k, v)
        with pytest.raises(ValueError, match="F32_F32_F32"):
            jflash.dot_product_attention(q, k, v, implementation="jflash")
        text = jax.jit(jflash.dot_product_attention).lower(q, k, v).as_text()
        assert "jflash_fwd" not in text
        # An explicit precision still runs the kernels.
        fn = functools.partial(jflash.flash_attention, precision="highest")
        assert _tf32_passes_in(fn, q, k, v) == {3}


# ------------------------------------------------------------------ the attribute

@pytest.mark.parametrize("precision, passes", [(None, 1), ("high", 1), ("highest", 3),
                                               (Precision.HIGHEST, 3)], ids=repr)
def test_attribute_in_forward_and_backward(rng, precision, passes):
    q, k, v = _inputs(rng)

    def loss(q, k, v):
        return jnp.sum(jflash.flash_attention(q, k, v, causal=True, precision=precision) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = jax.jit(grad).lower(q, k, v).as_text()
    assert "jflash_fwd" in text and "jflash_bwd" in text
    assert {int(x) for x in _ATTRIBUTE.findall(text)} == {passes}


def test_half_precision_inputs_pass_one(rng):
    """float16 and bfloat16 kernels have one precision: the attribute is 1 whatever
    precision says (the same program as without it)."""
    for dtype in (jnp.bfloat16, jnp.float16):
        q, k, v = _inputs(rng, dtype=dtype)
        fn = functools.partial(jflash.flash_attention, precision="highest")
        assert _tf32_passes_in(fn, q, k, v) == {1}
        plain = jax.jit(jflash.flash_attention).lower(q, k, v).as_text()
        assert jax.jit(fn).lower(q, k, v).as_text() == plain


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_half_precision_results_do_not_change(rng, dtype):
    q, k, v = _inputs(rng, dtype=dtype)
    dout = jnp.asarray(rng.standard_normal(q.shape), dtype)

    def run(precision):
        fn = functools.partial(jflash.flash_attention, causal=True, precision=precision)
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(dout))

    want = run(None)
    for precision in ("highest", Precision.HIGH, ("default", "highest")):
        for got, ref in zip(run(precision), want):
            assert got.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_float32_stays_float32(rng):
    q, k, v = _inputs(rng)
    for precision in (None, "highest"):
        fn = functools.partial(jflash.flash_attention, precision=precision, return_lse=True)
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        grads = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
        assert out.dtype == lse.dtype == jnp.float32
        assert all(g.dtype == jnp.float32 for g in grads)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernels' float32")
def test_cpu_float32_ignores_precision(rng):
    """On CPU float32 is computed in float32 at either setting: the same results,
    bit for bit, within the error rule of a float32 computation."""
    q, k, v = _inputs(rng, (2, 61, 77, 4, 2, 64))
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def run(precision):
        fn = functools.partial(jflash.flash_attention, causal=True, precision=precision)
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(dout))

    default, highest = run("default"), run("highest")
    for a, b in zip(default, highest):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lo, hi = window_diags(61, 77, True, (None, None))
    scale = 1 / np.sqrt(64)
    truth_out, _, _ = reference64.forward(*float64_inputs(q, k, v), scale, lo, hi)
    truth = reference64.backward(*float64_inputs(q, k, v, dout), np.zeros((2, 4, 61)), scale,
                                 lo, hi)
    for name, got, exact in zip(("out", "dq", "dk", "dv"), default, (truth_out, *truth)):
        assert max_err(got, exact) <= 1e-5 * max(1.0, float(np.max(np.abs(exact)))), name


# ------------------------------------------------------------------ head-dim padding

def test_float32_head_dims():
    assert FLOAT32_HEAD_DIMS == (64, 128, 256)
    from jflash._src.kernel_calls import padded_head_dim

    assert [padded_head_dim(d, float32=True) for d in (1, 32, 64, 65, 96, 128, 160, 192, 256)] \
        == [64, 64, 64, 128, 128, 128, 256, 256, 256]
    assert padded_head_dim(32) == 32 and padded_head_dim(96) == 96  # half precision: unchanged


@pytest.mark.parametrize("head_dim, kernel_head_dim", [(32, 64), (96, 128), (160, 256)])
def test_float32_head_dim_padding(rng, head_dim, kernel_head_dim):
    """float32 calls pad their head dim up to 64, 128 or 256 (on every platform),
    and the results are those of the unpadded head dim."""
    shape = (2, 41, 53, 4, 2, head_dim)
    q, k, v = qkv_inputs(rng, shape, jnp.float32)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    fn = functools.partial(jflash.flash_attention, causal=True, precision="highest")
    text = jax.jit(fn).lower(q, k, v).as_text()
    call = next(line for line in text.splitlines() if "jflash_fwd" in line)
    assert f"tensor<2x41x4x{kernel_head_dim}xf32>" in call
    out, vjp = jax.vjp(fn, q, k, v)
    grads = vjp(dout)
    assert out.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    lo, hi = window_diags(41, 53, True, (None, None))
    scale = 1 / np.sqrt(head_dim)
    truth_out, _, _ = reference64.forward(*float64_inputs(q, k, v), scale, lo, hi)
    truth = reference64.backward(*float64_inputs(q, k, v, dout), np.zeros((2, 4, 41)), scale,
                                 lo, hi)
    # float32 on CPU; on a GPU the 3xTF32 kernels: float32-class either way.
    for name, got, exact in zip(("out", "dq", "dk", "dv"), (out, *grads), (truth_out, *truth)):
        assert max_err(got, exact) <= 2e-5 * max(1.0, float(np.max(np.abs(exact)))), name


# ------------------------------------------------------------------ other entry points

def test_varlen_passes_precision(rng):
    q, k, v = _inputs(rng, (1, 50, 50, 4, 2, 64))
    cu = jnp.asarray([0, 20, 50], jnp.int32)

    def fn(precision):
        return functools.partial(jflash.flash_attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 max_seqlen_q=30, max_seqlen_k=30, causal=True,
                                 precision=precision)

    assert _tf32_passes_in(fn("highest"), q[0], k[0], v[0]) == {3}
    assert _tf32_passes_in(fn(None), q[0], k[0], v[0]) == {1}
    with pytest.raises(ValueError, match="jflash: precision 'bogus'"):
        fn("bogus")(q[0], k[0], v[0])


def test_dot_product_attention_reads_the_config(rng):
    """jax.nn.dot_product_attention has no precision argument: the drop-in uses
    jax_default_matmul_precision, as jax's float32 dots do."""
    q, k, v = _inputs(rng, (2, 30, 30, 4, 2, 64))
    assert _tf32_passes_in(jflash.dot_product_attention, q, k, v) == {1}
    with jax.default_matmul_precision("highest"):
        assert _tf32_passes_in(jflash.dot_product_attention, q, k, v) == {3}


def test_ring_attention_passes_precision(rng):
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    # Host CPU devices (conftest.py makes 8), so that this runs beside a single GPU too.
    cpus = jax.devices("cpu")[:4]
    mesh = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Auto,), devices=cpus)
    q, k, v = (jax.device_put(x, jax.sharding.NamedSharding(mesh, P()))
               for x in _inputs(rng, (1, 64, 64, 2, 2, 32)))

    def fn(precision):
        ring = functools.partial(jflash.context_parallel.ring_attention, axis_name="s",
                                 causal=True, precision=precision)
        return jax.shard_map(ring, mesh=mesh, in_specs=P(None, "s"), out_specs=P(None, "s"))

    text = jax.jit(fn("highest")).lower(q, k, v).as_text()
    assert {int(x) for x in _ATTRIBUTE.findall(text)} == {3}
    assert "x64xf32>" in text  # head dim 32 padded to float32's 64
    got = jax.jit(fn("highest"))(q, k, v)
    want = jflash.flash_attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="jflash: precision"):
        jax.jit(fn("low")).lower(q, k, v)


def test_context_parallel_passes_precision(rng):
    """A sequence-sharded call runs context-parallel inside the partitioner's
    lowering: its kernel calls carry the precision too."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Auto,),
                         devices=jax.devices("cpu")[:4])
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P(None, "s")))
               for x in _inputs(rng, (1, 64, 64, 2, 2, 64)))

    def loss(q, k, v):
        out = jflash.flash_attention(q, k, v, causal=True, precision="highest")
        return jnp.sum(out ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    assert "collective-permute" in text or "all-gather" in text  # context-parallel, not gathered
    assert "jflash_fwd" in text and "jflash_bwd" in text
    assert set(_ATTRIBUTE.findall(text)) == {"3"}


# ------------------------------------------------------------------ GPU accuracy

def _has_float32_kernels():
    """A CUDA GPU whose float32 kernels run: built, and >= 163 KB of shared memory
    per block (GPUs with less raise an error that says so; any other failure of
    the trial call is left to the tests to report)."""
    if jax.default_backend() != "gpu" or not jflash.HAS_CUDA_KERNELS:
        return False
    if cuda_forward_family(jnp.float32, 128, False) <= 0:
        return False
    x = jnp.ones((1, 1, 1, 64), jnp.float32)
    try:
        jax.block_until_ready(jflash.flash_attention(x, x, x))
    except Exception as e:  # noqa: BLE001
        return "163 KB" not in str(e)
    return True


needs_float32_kernels = pytest.mark.skipif(
    not _has_float32_kernels(),
    reason="needs a CUDA GPU with jflash's float32 kernels (sm80/sm90, >= 163 KB shared memory "
           "per block)",
)

# Added to 2x XLA's error, times max(1, max|truth|): matters only where XLA's
# computation happens to be (nearly) exact.
_GPU_FLOOR = 1e-6

# XLA's attention, the yardstick, compiles with XLA's own gemm defaults: the
# suite's flags (conftest.py: cuBLAS gemms, no autotuning, for speed) change
# its precision at DEFAULT. On an H200 they took the odd-lengths case's dk and
# dv to float32's error and its dq to half TF32's, against TF32's with XLA's
# defaults (docs/cuda_kernels.md, "float32").
_XLA_DEFAULT_GEMMS = {"xla_gpu_enable_triton_gemm": True, "xla_gpu_autotune_level": 4}

# (name, (batch, seq_q, seq_k, heads, heads_kv, head_dim), mask, softcap):
# mask None (none), "causal" (bottom-right), ("window", left, right), or
# "segments" (packed documents plus query rows whose id no key has).
GPU_CASES = [
    ("odd-lengths", (2, 113, 257, 4, 4, 64), None, None),
    ("gqa", (1, 200, 160, 8, 2, 128), None, None),
    ("causal-rows-without-keys", (1, 257, 113, 8, 2, 128), "causal", None),  # 144 rows see none
    ("causal-short-q", (1, 113, 257, 4, 4, 256), "causal", None),
    ("hd96-window", (2, 150, 150, 4, 2, 96), ("window", 20, 5), None),
    ("segments", (2, 160, 160, 4, 2, 64), "segments", None),
    ("softcap", (1, 113, 257, 8, 2, 128), None, 5.0),
]


def _case_mask(shape, mask):
    """(diag_lo, diag_hi, segment ids or None) of a case, and jax.nn's boolean mask
    [batch or 1, 1, seq_q, seq_k]."""
    batch, seq_q, seq_k = shape[:3]
    if mask == "causal":
        lo, hi = window_diags(seq_q, seq_k, True, (None, None))
    elif isinstance(mask, tuple):
        lo, hi = window_diags(seq_q, seq_k, False, mask[1:])
    else:
        lo, hi = -seq_q, seq_k
    ids = None
    if mask == "segments":
        docs = [40, 1, 70, 49]  # 160 positions
        q_ids = np.stack([packed_ids(docs, [0, 1, 2, 3])] * batch)
        q_ids[:, 100:104] = 9  # no key has id 9: rows without keys
        ids = (q_ids, np.stack([packed_ids(docs, [0, 1, 2, 3])] * batch))
    visible = reference64.visible_mask(seq_q, seq_k, lo, hi, *(ids or (None, None)))
    visible = visible.reshape(-1, 1, seq_q, seq_k)
    return lo, hi, ids, visible


def _xla_attention(q, k, v, visible, scale, softcap):
    """XLA's attention at the matmul precision in context: jax.nn.dot_product_attention
    (implementation="xla") with the case's mask; with softcap, the same steps in
    jnp (jax.nn has no softcap): float32 logits of q.k, capped, masked, softmax,
    times v."""
    if softcap is None:
        return jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(visible), scale=scale,
                                            implementation="xla")
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    logits = softcap * jnp.tanh(logits / softcap)
    logits = jnp.where(jnp.asarray(visible), logits, -0.7 * np.finfo(np.float32).max)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def _case_errors(rng, case, precision):
    """(jflash's, XLA's) max |error| of out, dq, dk, dv against float64, both at
    precision, and the truth's max |.| of each, for one GPU case."""
    _, shape, mask, softcap = case
    q, k, v = qkv_inputs(rng, shape, jnp.float32)
    lo, hi, ids, visible = _case_mask(shape, mask)
    has_key = visible.any(-1)[:, 0]  # [batch or 1, seq_q]
    # The cotangent is 0 on rows without keys: there XLA outputs the mean of the
    # values (jflash and the truth 0), and a zero cotangent keeps that out of
    # XLA's gradients.
    dout = rng.standard_normal(q.shape) * has_key[:, :, None, None]
    dout = jnp.asarray(dout, jnp.float32)
    scale = 1 / np.sqrt(shape[5])
    kw = dict(causal=mask == "causal", softcap=softcap,
              window_size=mask[1:] if isinstance(mask, tuple) else None)
    if ids is not None:
        kw.update(q_segment_ids=jnp.asarray(ids[0]), kv_segment_ids=jnp.asarray(ids[1]))

    def jflash_fn(q, k, v):
        return jflash.flash_attention(q, k, v, precision=precision, **kw)

    def xla_fn(q, k, v):
        return _xla_attention(q, k, v, visible, scale, softcap)

    def run(fn, compiler_options=None):
        def grads(q, k, v, dout):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(dout))

        return jax.jit(grads).lower(q, k, v, dout).compile(compiler_options)(q, k, v, dout)

    got = run(jflash_fn)
    with jax.default_matmul_precision(precision or "default"):
        xla = run(xla_fn, _XLA_DEFAULT_GEMMS)
    xla = (jnp.where(jnp.asarray(has_key)[:, :, None, None], xla[0], 0), *xla[1:])
    truth_out, _, _ = reference64.forward(*float64_inputs(q, k, v), scale, lo, hi, ids, softcap)
    truth = reference64.backward(*float64_inputs(q, k, v, dout), np.zeros((shape[0], shape[3],
                                 shape[1])), scale, lo, hi, ids, softcap)
    truth = (truth_out, *truth)
    assert all(g.dtype == jnp.float32 for g in got)
    rows_without_keys = ~np.broadcast_to(has_key, (shape[0], shape[1]))
    assert np.all(np.asarray(got[0])[rows_without_keys] == 0)
    return ([max_err(g, t) for g, t in zip(got, truth)],
            [max_err(x, t) for x, t in zip(xla, truth)],
            [float(np.max(np.abs(t))) for t in truth])


@needs_float32_kernels
@pytest.mark.parametrize("precision", [None, "highest"], ids=["default", "highest"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_float32_accuracy_rule(rng, case, precision):
    """max|jflash - truth| <= 2 max|XLA - truth| + floor, XLA at the same precision
    (None: the default, TF32; "highest": float32 dots), for out, dq, dk, dv."""
    ours, xla, magnitude = _case_errors(rng, case, precision)
    for name, a, b, m in zip(("out", "dq", "dk", "dv"), ours, xla, magnitude):
        bound = 2 * b + _GPU_FLOOR * max(1.0, m)
        assert a <= bound, f"{name}: jflash error {a:.3g} > bound {bound:.3g} (XLA {b:.3g})"


@needs_float32_kernels
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[4]], ids=lambda c: c[0])
def test_highest_is_more_accurate_than_default(rng, case):
    """3xTF32 against TF32 on the same inputs: several times smaller errors (TF32
    keeps 10 mantissa bits of each operand; 3xTF32 about float32's 23)."""
    seed = int(rng.integers(1 << 30))
    default, _, _ = _case_errors(np.random.default_rng(seed), case, None)
    highest, _, _ = _case_errors(np.random.default_rng(seed), case, "highest")
    for name, d, h in zip(("out", "dq", "dk", "dv"), default, highest):
        assert h * 8 <= d, f"{name}: highest error {h:.3g} not 8x below default's {d:.3g}"
