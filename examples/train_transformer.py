"""Train a small decoder-only transformer with jflash attention, data-parallel.

The task is generated, no download: each sequence is random tokens followed by
the same tokens again, and the loss counts the second half only. A model can
only get it right by attending back exactly one half-length, so the loss
falling from log(vocab) towards zero shows the attention at work.

Data parallel over every local device: the batch is sharded along a "data" mesh
axis and jax.jit partitions the step, jflash's kernels included (each device
runs attention on its own batch shard). On CPU, try several host devices:

    python examples/train_transformer.py --host-devices 8

--context-parallel N shards the sequence over N devices as well (a
("data", "seq") mesh): tokens are put in the zigzag layout with
jflash.context_parallel.shard_sequence, and jflash's attention runs
context-parallel over "seq" (--cp-strategy: ring, all_gather, or auto, which
picks by jflash.context_parallel.choose_strategy). For example, on 8 simulated
CPU devices:

    python examples/train_transformer.py --host-devices 8 --context-parallel 4

--head-parallel N adds a "model" mesh axis of N devices (a ("data", "seq",
"model") mesh): Megatron-style, the q/k/v projections are sharded on their
heads, the output projection on its input heads, the MLP's first layer on its
output and the second on its input (model_parallel_spec); each device runs
attention on its own heads, and the blocks' outputs are summed over "model".
--heads and --kv-heads must be multiples of N. All three axes combine:

    python examples/train_transformer.py --host-devices 8 --context-parallel 2 --head-parallel 2

At the end the run reports the median step time and tokens/s over the steps
after --warmup-steps; --results PATH writes them as JSON with the settings,
devices and mesh, and the collectives (all-gather, all-reduce, ...) counted in
the compiled step, all-gathers of q/k/v-shaped arrays listed apart
(--dump-collectives PATH writes the collectives alone).

The same model with jax.nn.dot_product_attention (implementation="xla") is
trained beside it for the first --check-steps steps from the same parameters
and data; the two losses must agree at that step within --check-rtol. Uses the
CUDA kernels when jax sees a GPU (then in bfloat16), the CPU kernels otherwise.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import re
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32, help="global batch (rounded up to devices)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="fewer than --heads: GQA")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-steps", type=int, default=100, help="0 to skip the comparison")
    p.add_argument("--check-rtol", type=float, default=None, help="default 1e-3 f32, 3e-2 bf16")
    p.add_argument("--host-devices", type=int, default=None,
                   help="CPU devices to simulate (the run then uses the CPU, also where a GPU is)")
    p.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="shard the sequence over N devices (context-parallel, zigzag layout)")
    p.add_argument("--cp-strategy", default="auto", choices=("auto", "ring", "all_gather"))
    p.add_argument("--head-parallel", type=int, default=1, metavar="N",
                   help="shard attention heads and the MLP over N devices (a 'model' mesh axis)")
    p.add_argument("--warmup-steps", type=int, default=3, metavar="W",
                   help="steps left out of the step time report (compilation, warm-up)")
    p.add_argument("--results", metavar="PATH", help="write the run's settings and timings as JSON")
    p.add_argument("--dump-collectives", metavar="PATH",
                   help="write the collectives of the compiled step as JSON (--results has them too)")
    return p.parse_args()


ARGS = parse_args()
if ARGS.host_devices:
    # Must be set before jax starts its backends. Without JAX_PLATFORMS a GPU
    # would be the default backend and the simulated devices go unused.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={ARGS.host_devices}"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jflash  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under python3 -P
from transformer import Transformer  # noqa: E402  (examples/transformer.py)


def model_parallel_spec(path):
    """The PartitionSpec of a parameter over the "model" mesh axis, from its path
    in the parameter tree (Megatron-style tensor parallelism). Matches, in each
    Block_i:
      MultiHeadAttention_0/{query,key,value}: kernel [d_model, heads, head_dim]
        and bias [heads, head_dim] sharded on heads, so attention runs
        head-sharded on each device's own heads;
      MultiHeadAttention_0/out: kernel [heads, head_dim, d_model] sharded on heads
        (its input), the bias replicated;
      Dense_0 (the MLP's first layer): kernel and bias sharded on the output;
      Dense_1 (the second): kernel sharded on the input, the bias replicated.
    Everything else is replicated: pos, Embed_0, the LayerNorms and the vocab
    head (the Dense_0 outside the blocks).
    """
    names = [entry.key for entry in path]
    if not names[0].startswith("Block_"):
        return P()
    layer, leaf = names[-2], names[-1]
    if layer in ("query", "key", "value"):
        return P(None, "model", None) if leaf == "kernel" else P("model", None)
    if layer == "out" and leaf == "kernel":
        return P("model", None, None)
    if layer == "Dense_0":
        return P(None, "model") if leaf == "kernel" else P("model")
    if layer == "Dense_1" and leaf == "kernel":
        return P("model", None)
    return P()


def copy_task_batch(rng, batch, seq_len, vocab):
    """inputs, targets [batch, seq_len] and loss weights (1 on the copied half)."""
    half = (seq_len + 1) // 2
    first = rng.integers(0, vocab, size=(batch, half), dtype=np.int32)
    tokens = np.concatenate([first, first], axis=1)
    if tokens.shape[1] < seq_len + 1:
        tokens = np.concatenate([tokens, first[:, :1]], axis=1)
    weights = (np.arange(seq_len) >= half - 1).astype(np.float32)  # target t+1 >= half
    return tokens[:, :seq_len], tokens[:, 1 : seq_len + 1], np.broadcast_to(weights, (batch, seq_len))


def loss_fn(model, params, inputs, targets, weights, positions=None):
    logits = model.apply({"params": params}, inputs, positions)
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.sum(weights)


def adam(lr, b1=0.9, b2=0.99, eps=1e-8):
    """Plain Adam (no optimizer dependency): (init, update) on parameter pytrees."""

    def init(params):
        def zeros():  # m and v each their own buffers: the train step donates them
            return jax.tree.map(jnp.zeros_like, params)

        return dict(m=zeros(), v=zeros(), t=jnp.zeros((), jnp.int32))

    def update(params, grads, state):
        t = state["t"] + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
        m_hat_scale = 1 / (1 - b1 ** t.astype(jnp.float32))
        v_hat_scale = 1 / (1 - b2 ** t.astype(jnp.float32))
        params = jax.tree.map(
            lambda p, m, v: p - lr * m * m_hat_scale / (jnp.sqrt(v * v_hat_scale) + eps),
            params,
            m,
            v,
        )
        return params, dict(m=m, v=v, t=t)

    return init, update


def make_train_step(model, optimizer_update, shardings, positions=None, context=None):
    """A jitted step. shardings: the (params, opt_state, loss) shardings that the
    step returns; parameters and optimizer state are donated (updated in place).
    context(), when given, is entered around each call and lowering (jflash
    reads its context-parallel settings when the step is traced)."""

    @functools.partial(jax.jit, out_shardings=shardings, donate_argnums=(0, 1))
    def train_step(params, opt_state, inputs, targets, weights):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(model, p, inputs, targets, weights, positions)
        )(params)
        params, opt_state = optimizer_update(params, grads, opt_state)
        return params, opt_state, loss

    if context is None:
        return train_step

    def step_in_context(*args):
        with context():
            return train_step(*args)

    def lower(*args):
        with context():
            return train_step.lower(*args)

    step_in_context.lower = lower
    return step_in_context


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
# An HLO instruction: "%name = shape opcode(operands), attributes"; the shape may be a tuple.
HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[^\s=]+) = (?P<shape>.+?) "
                             r"(?P<op>[a-z][a-z0-9-]*)\((?P<operands>[^)]*)\)(?P<attributes>.*)$")


def hlo_shapes(text):
    """The array shapes in an HLO shape string, e.g. "(f32[8,64]{1,0}, s32[])"."""
    return [[int(d) for d in dims.split(",") if d]
            for dims in re.findall(r"\b[a-z]+[0-9]*\[([0-9,]*)\]", text)]


def collectives_report(hlo_text, attention_shapes):
    """Counts the collectives of a compiled (SPMD-partitioned) HLO module, each
    op once as written in the program (an async -start/-done pair as one, a
    combined op over several arrays as one; ops in loops are not multiplied by
    trip counts), and lists the all-gathers with their operand and result
    shapes. An all-gather whose operand or result has a shape in
    attention_shapes (q, k, v [batch, seq, heads, head_dim], per device or
    whole) is listed again under attention_all_gathers: with batch and head
    sharding there should be none. (The context-parallel all_gather strategy
    gathers K/V along the sequence, dimension 1, on purpose.)"""
    shapes, found = {}, []
    for line in hlo_text.splitlines():
        m = HLO_INSTRUCTION.match(line)
        if not m:
            continue
        shapes[m["name"]] = m["shape"]
        op = m["op"].removesuffix("-start")
        if op in COLLECTIVES:
            found.append((op, m))
    counts = dict.fromkeys(COLLECTIVES, 0)
    all_gathers = []
    for op, m in found:
        counts[op] += 1
        if op != "all-gather":
            continue
        operands = re.findall(r"%([^\s,)]+)", m["operands"])
        dims = re.search(r"dimensions=\{([0-9,]*)\}", m["attributes"])
        op_name = re.search(r'op_name="([^"]*)"', m["attributes"])
        all_gathers.append(dict(
            operand_shapes=[s for name in operands for s in hlo_shapes(shapes.get(name, ""))],
            result_shapes=hlo_shapes(m["shape"]),
            dimensions=[int(d) for d in dims[1].split(",") if d] if dims else None,
            op_name=op_name[1] if op_name else None,
        ))
    attention = [g for g in all_gathers
                 if any(tuple(s) in attention_shapes
                        for s in g["operand_shapes"] + g["result_shapes"])]
    return dict(counts=counts, all_gathers=all_gathers, attention_all_gathers=attention)


class Progress:
    """A plain-text progress bar: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total, width=30, stream=sys.stderr):
        self.total, self.width, self.stream = total, width, stream
        self.start = time.perf_counter()
        self.tty = stream.isatty()
        self.last_tenth = -1

    def update(self, step, **values):
        done = step / self.total
        tenth = int(done * 10)
        if not self.tty and tenth == self.last_tenth and step != self.total:
            return
        self.last_tenth = tenth
        bar = "#" * int(done * self.width) + "." * (self.width - int(done * self.width))
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        text = " ".join(f"{k} {v:.4f}" for k, v in values.items())
        line = f"[{bar}] {step}/{self.total} {text} {rate:.1f} steps/s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and step == self.total:
            self.stream.write("\n")
        self.stream.flush()


def main(args):
    devices = jax.devices()
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    rtol = args.check_rtol or (3e-2 if dtype == jnp.bfloat16 else 1e-3)
    cp, hp = args.context_parallel, args.head_parallel
    if cp < 1 or hp < 1 or len(devices) % (cp * hp):
        raise SystemExit(
            f"--context-parallel {cp} times --head-parallel {hp} must divide the "
            f"{len(devices)} devices"
        )
    if cp > 1 and args.seq_len % (2 * cp):
        raise SystemExit(
            f"--context-parallel {cp}: --seq-len {args.seq_len} must be a multiple of 2 * {cp} "
            "(the zigzag layout cuts the sequence into 2 chunks per device)"
        )
    if args.heads % hp or args.kv_heads % hp:
        raise SystemExit(
            f"--head-parallel {hp} must divide --heads {args.heads} and --kv-heads "
            f"{args.kv_heads} (each device runs attention on its own query and kv heads)"
        )
    data_devices = len(devices) // (cp * hp)
    batch = -(-args.batch // data_devices) * data_devices  # a multiple of the data axis
    print(
        f"{len(devices)} {jax.default_backend()} device(s), global batch {batch}, "
        f"{dtype.__name__}, jflash CUDA kernels built: {jflash.HAS_CUDA_KERNELS}"
        + (f", sequence over {cp} devices ({args.cp_strategy})" if cp > 1 else "")
        + (f", heads over {hp} devices" if hp > 1 else "")
    )

    # Data parallel: the batch is split over a "data" mesh axis; jit partitions
    # the step from the shardings of its operands.
    # Context parallel: the sequence is split over a "seq" axis as well.
    # Head parallel: the attention heads and the MLP's hidden units are split over
    # a "model" axis (model_parallel_spec); everything else is replicated.
    mesh = jax.make_mesh((data_devices, cp, hp), ("data", "seq", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    data_sharding = NamedSharding(mesh, P("data", "seq" if cp > 1 else None))
    replicated = NamedSharding(mesh, P())

    config = dict(
        vocab=args.vocab,
        d_model=args.d_model,
        layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_len=args.seq_len,
        dtype=dtype,
    )
    model = Transformer(**config, implementation="jflash")

    data_rng = np.random.default_rng(args.seed)
    sample = copy_task_batch(data_rng, batch, args.seq_len, args.vocab)[0]
    params = model.init(jax.random.key(args.seed), sample)["params"]
    param_shardings = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, model_parallel_spec(path)), params
    )
    params = jax.device_put(params, param_shardings)
    init, update = adam(args.lr)
    # The optimizer state is sharded like the parameters (its step count replicated).
    opt_shardings = dict(m=param_shardings, v=param_shardings, t=replicated)
    opt_state = jax.device_put(init(params), opt_shardings)
    step_shardings = (param_shardings, opt_shardings, replicated)
    if cp > 1:
        from jflash.context_parallel import shard_sequence

        def layout(x):  # tokens into the zigzag layout: balanced causal work
            return shard_sequence(x, cp)

        positions = np.asarray(layout(np.arange(args.seq_len)[None]))[0]

        @contextlib.contextmanager
        def context():
            with jflash.context_parallel_strategy(args.cp_strategy):
                with jflash.sequence_layout("zigzag", cp):
                    yield
    else:
        positions, context = None, None

        def layout(x):
            return x

    train_step = make_train_step(model, update, step_shardings, positions, context)
    if args.check_steps > 0:
        # The same model on jax.nn.dot_product_attention, from a copy of the same
        # parameters (the steps donate theirs); unsharded sequence, token order.
        reference = Transformer(**config, implementation="xla")
        reference_step = make_train_step(reference, update, step_shardings)
        ref_params, ref_state = jax.tree.map(jnp.copy, (params, opt_state))

    # Each step is timed from its call to its loss on the host (float(loss)
    # waits for the step), the data already on the devices and the reference
    # step finished; the first --warmup-steps (compilation among them) are left out.
    progress = Progress(args.steps)
    check, step_times = None, []
    for step in range(1, args.steps + 1):
        data = copy_task_batch(data_rng, batch, args.seq_len, args.vocab)
        if step <= args.check_steps:
            ref_params, ref_state, ref_loss = jax.block_until_ready(reference_step(
                ref_params, ref_state, *(jax.device_put(x, NamedSharding(mesh, P("data")))
                                         for x in data)
            ))
        inputs, targets, weights = jax.block_until_ready(tuple(
            jax.device_put(np.asarray(layout(x)), data_sharding) for x in data
        ))
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, inputs, targets, weights)
        loss = float(loss)
        if step > args.warmup_steps:
            step_times.append(time.perf_counter() - start)
        if step == args.check_steps:
            check = (loss, float(ref_loss))
        progress.update(step, loss=loss)

    print(f"final loss {loss:.4f} (log(vocab) = {np.log(args.vocab):.4f})")
    timing = dict(timed_steps=len(step_times), median_step_ms=None, min_step_ms=None,
                  tokens_per_s=None)
    if step_times:
        median = statistics.median(step_times)
        timing.update(median_step_ms=median * 1e3, min_step_ms=min(step_times) * 1e3,
                      tokens_per_s=batch * args.seq_len / median)
        print(
            f"step time over steps {args.warmup_steps + 1}-{args.steps}: median "
            f"{timing['median_step_ms']:.2f} ms, min {timing['min_step_ms']:.2f} ms, "
            f"{timing['tokens_per_s']:.0f} tokens/s ({batch} x {args.seq_len} tokens a step)"
        )
    else:
        print(f"no step timed: --steps {args.steps} <= --warmup-steps {args.warmup_steps}")

    collectives = None
    if args.dump_collectives or args.results:
        hlo = train_step.lower(params, opt_state, inputs, targets, weights).compile().as_text()
        head_dim = args.d_model // args.heads
        attention_shapes = {  # q, k, v: [batch, seq, heads, head_dim], per device or whole
            (b, s, h, head_dim)
            for b in (batch, batch // data_devices)
            for s in (args.seq_len, args.seq_len // cp)
            for h in (args.heads, args.kv_heads, args.heads // hp, args.kv_heads // hp)
        }
        collectives = collectives_report(hlo, attention_shapes)
        print(
            "collectives in the compiled step: "
            + ", ".join(f"{op} {n}" for op, n in collectives["counts"].items())
            + f"; all-gathers of q/k/v-shaped arrays: {len(collectives['attention_all_gathers'])}"
        )
        gathers = collections.Counter(
            f"{g['operand_shapes']} -> {g['result_shapes']} along dimension {g['dimensions']}"
            for g in collectives["attention_all_gathers"]
        )
        for gather, n in gathers.items():
            print(f"  {n} x all-gather {gather} (dimensions: 0 batch, 1 sequence, 2 heads)")
        if args.dump_collectives:
            with open(args.dump_collectives, "w") as f:
                json.dump(collectives, f, indent=2)
                f.write("\n")

    ok = True
    if check is not None:
        ours, theirs = check
        rel = abs(ours - theirs) / max(abs(theirs), 1e-12)
        ok = rel <= rtol
        print(
            f"loss at step {args.check_steps}: jflash {ours:.6f}, jax.nn.dot_product_attention "
            f"{theirs:.6f}, relative difference {rel:.2e} (tolerance {rtol:g}): "
            + ("OK" if ok else "MISMATCH")
        )
        check = dict(step=args.check_steps, jflash=ours, reference=theirs,
                     relative_difference=rel, rtol=rtol, ok=ok)

    if args.results:
        memory = [d.memory_stats() for d in devices]  # None on CPU
        results = dict(
            args=vars(args),
            jax_version=jax.__version__,
            jflash_version=jflash.__version__,
            backend=jax.default_backend(),
            device_kind=devices[0].device_kind,
            device_count=len(devices),
            mesh=dict(mesh.shape),
            global_batch=batch,
            dtype=dtype.__name__,
            **timing,
            final_loss=loss,
            peak_bytes_in_use=[m and m.get("peak_bytes_in_use") for m in memory],
            check=check,
            collectives=collectives,
        )
        with open(args.results, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
        print(f"results written to {args.results}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
