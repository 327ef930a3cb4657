"""The peer the kit must beat on one GPU: a competent hand-written GPT training loop.

What a user who knows JAX writes without the kit (issue 16): plain `jax.jit` (no donation, no
sharding), optax Adam, fp32 parameters, bf16 compute everywhere including the tied output
projection, `jax.nn.dot_product_attention(..., implementation="cudnn")`, and optax's
integer-label cross-entropy over the bf16 logits upcast to fp32. The architecture and the parameter count
are the kit's GPT's (pre-LayerNorm, learned positions, tanh-GELU MLP of width 4d, tied
embedding), so the two do the same FLOPs; the bench asserts the counts match.

No kit imports: this file is the yardstick, not the thing measured.
"""

from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
import optax

COMPUTE = jnp.bfloat16
ATTENTION = "cudnn" if jax.default_backend() == "gpu" else "xla"  # "xla" only for a CPU smoke run


def init_params(rng, num_layers: int, d_model: int, vocab_size: int, seq_len: int, num_heads: int) -> Dict:
    keys = iter(jax.random.split(rng, 4 * num_layers + 2))

    def normal(shape):
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

    def ln():
        return {"scale": jnp.ones((d_model,), jnp.float32), "bias": jnp.zeros((d_model,), jnp.float32)}

    layers = []
    for _ in range(num_layers):
        layers.append(
            {
                "ln1": ln(),
                "ln2": ln(),
                # q, k and v's projections as one [d, 3, heads, head_dim] weight: the product splits by
                # indexing, not jnp.split of a [.., 3d] output (whose backward concatenates dq, dk, dv).
                "w_qkv": normal((d_model, 3, num_heads, d_model // num_heads)),
                "b_qkv": jnp.zeros((3, num_heads, d_model // num_heads), jnp.float32),
                "w_out": normal((d_model, d_model)),
                "b_out": jnp.zeros((d_model,), jnp.float32),
                "w_up": normal((d_model, 4 * d_model)),
                "b_up": jnp.zeros((4 * d_model,), jnp.float32),
                "w_down": normal((4 * d_model, d_model)),
                "b_down": jnp.zeros((d_model,), jnp.float32),
            }
        )
    return {"wte": normal((vocab_size, d_model)), "wpe": normal((seq_len, d_model)), "layers": layers, "ln_f": ln()}


def layer_norm(x, p, eps: float = 1e-6):
    """In fp32, both moments from one pass over x (var = E[x^2] - E[x]^2, as flax's LayerNorm does):
    the centred two-pass form costs XLA a second reduction kernel per norm (2.5 ms a step on GPT 12L)."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.maximum(jnp.square(xf).mean(-1, keepdims=True) - jnp.square(mean), 0.0)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]
    return y.astype(COMPUTE)


def dense(x, w, b):
    return x @ w.astype(COMPUTE) + b.astype(COMPUTE)


def forward(params, tokens, num_heads: int):
    batch, seq = tokens.shape
    x = (params["wte"][tokens] + params["wpe"][:seq]).astype(COMPUTE)
    d_model = x.shape[-1]
    for p in params["layers"]:
        qkv = jnp.einsum("bsd,dthk->bsthk", layer_norm(x, p["ln1"]), p["w_qkv"].astype(COMPUTE)) + p["b_qkv"].astype(COMPUTE)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=ATTENTION)
        x = x + dense(a.reshape(batch, seq, d_model), p["w_out"], p["b_out"])
        h = jax.nn.gelu(dense(layer_norm(x, p["ln2"]), p["w_up"], p["b_up"]))
        x = x + dense(h, p["w_down"], p["b_down"])
    x = layer_norm(x, params["ln_f"])
    return x @ params["wte"].astype(COMPUTE).T  # tied output projection, bf16 logits


def loss_fn(params, tokens, num_heads: int):
    logits = forward(params, tokens[:, :-1], num_heads)
    # optax's integer-label cross-entropy: log-sum-exp minus the label's logit, no full log-softmax.
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def train_step(tx, num_heads: int):
    """(params, opt_state, tokens) -> (params, opt_state, loss): the peer's step, before jit."""

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, num_heads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_loop(num_layers: int, d_model: int, num_heads: int, vocab_size: int, seq_len: int, learning_rate: float, tokens):
    """(run(n) -> last loss, [state] (a one-item list the caller may park on the host), n_params,
    compiled step) for the batch `tokens` [B, seq_len + 1]."""
    params = init_params(jax.random.PRNGKey(0), num_layers, d_model, vocab_size, seq_len, num_heads)
    tx = optax.adam(learning_rate)
    opt_state = tx.init(params)

    step = jax.jit(train_step(tx, num_heads))
    tokens = jax.device_put(tokens)
    compiled = step.lower(params, opt_state, tokens).compile()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    run, state = jit_run(step, params, opt_state, tokens)
    return run, state, n_params, compiled


def jit_run(step, params, opt_state, batch):
    """(run(n) -> last loss, [state]) for a plain-jit `step(params, opt_state, batch) -> (params,
    opt_state, loss)` on one fixed batch: run(n) does n steps from state[0] and leaves the result there."""
    state = [(params, opt_state)]

    def run(n: int):
        p, o = state[0]
        loss = None
        for _ in range(n):
            p, o, loss = step(p, o, batch)
        jax.block_until_ready(loss)
        state[0] = (p, o)
        return loss

    return run, state
