"""Generate tokens with a KV cache: a small decoder-only transformer in decode mode.

The model is the one of examples/train_transformer.py (examples/transformer.py:
pre-norm blocks of jflash.flax.linen.MultiHeadAttention with GQA, and an MLP),
with random parameters. Its attention layers run with decode=True: the prompt goes in as one
step, then each generated token as one step, each step appending its keys and
values to the layers' caches and attending over them with
jflash.flash_attention_with_kvcache. Tokens are picked greedily.

The logits of every step are checked against the model's full forward
(decode=False) on the same tokens: they must agree within --rtol (float32 on
CPU: tight; bfloat16 on GPU: bfloat16's rounding). Then the generation is
timed and its tokens per second printed.

    python3 examples/generate.py
    python3 examples/generate.py --batch 8 --prompt-len 64 --new-tokens 256
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # also under python3 -P
from transformer import Transformer  # noqa: E402  (examples/transformer.py)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="fewer than --heads: GQA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=None,
                   help="logits' tolerance, relative to their largest magnitude "
                        "(default 1e-4 in float32, 5e-2 in bfloat16)")
    return p.parse_args()


def main():
    args = parse_args()
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    total = args.prompt_len + args.new_tokens
    config = dict(vocab=args.vocab, d_model=args.d_model, layers=args.layers,
                  num_heads=args.heads, num_kv_heads=args.kv_heads, max_len=total, dtype=dtype)
    model = Transformer(**config)
    decoder = Transformer(**config, decode=True)
    key_params, key_prompt = jax.random.split(jax.random.key(args.seed))
    prompt = jax.random.randint(key_prompt, (args.batch, args.prompt_len), 0, args.vocab)
    full = jnp.zeros((args.batch, total), jnp.int32)
    positions = jnp.arange(total)[None]
    params = model.init(key_params, full, positions)["params"]
    # An init call in decode mode sizes the caches (total tokens) and attends as usual.
    empty_cache = decoder.init(key_params, full, positions)["cache"]

    def step(cache, tokens, positions):
        logits, mutated = decoder.apply({"params": params, "cache": cache}, tokens, positions,
                                        mutable=["cache"])
        return logits, mutated["cache"]

    @functools.partial(jax.jit, donate_argnums=(0,))
    def generate(cache, prompt):
        """(prompt + generated tokens, the logits of every position, the cache),
        greedy; the cache is donated and updated in place."""
        logits, cache = step(cache, prompt, jnp.arange(args.prompt_len)[None])
        first = jnp.argmax(logits[:, -1], -1)

        def one_token(carry, position):
            cache, token = carry
            logits, cache = step(cache, token[:, None], position[None, None])
            return (cache, jnp.argmax(logits[:, 0], -1)), (token, logits[:, 0])

        new_positions = jnp.arange(args.prompt_len, total)
        (cache, _), (tokens, step_logits) = jax.lax.scan(one_token, (cache, first),
                                                          new_positions)
        tokens = jnp.concatenate([prompt, tokens.T], 1)
        return tokens, jnp.concatenate([logits, jnp.swapaxes(step_logits, 0, 1)], 1), cache

    tokens, logits, _ = generate(jax.tree.map(jnp.copy, empty_cache), prompt)
    want = jax.jit(model.apply)({"params": params}, tokens, positions)
    scale = float(jnp.max(jnp.abs(want)))
    error = float(jnp.max(jnp.abs(logits - want))) / max(scale, 1e-30)
    rtol = args.rtol or (5e-2 if dtype == jnp.bfloat16 else 1e-4)
    print(f"{jax.devices()[0].device_kind}, {jnp.dtype(dtype).name}: decode logits against the "
          f"full forward: max error {error:.2e} of the largest logit (tolerance {rtol:.0e})")
    if not error <= rtol:
        raise SystemExit(f"decode logits differ from the full forward: {error:.3g} > {rtol:.3g}")

    cache = jax.tree.map(jnp.copy, empty_cache)
    jax.block_until_ready(cache)
    start = time.perf_counter()
    tokens, _, _ = generate(cache, prompt)
    jax.block_until_ready(tokens)
    seconds = time.perf_counter() - start
    print(f"generated {args.new_tokens} tokens x {args.batch} sequences in {seconds * 1e3:.1f} ms: "
          f"{args.new_tokens * args.batch / seconds:.0f} tokens/s (prompt {args.prompt_len})")
    print("first sequence:", np.asarray(tokens[0]).tolist())


if __name__ == "__main__":
    main()
