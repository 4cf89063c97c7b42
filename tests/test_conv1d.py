"""Depthwise causal conv1d with state: a fresh sequence equals torch's zero-padded conv (HF's GDN
prefill), a continued one equals one pass, and the one-token step equals the step form."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from jaxinfer.kernels import conv1d


def test_fresh_sequences_equal_torchs_padded_conv_and_continue_exactly():
    rng = np.random.RandomState(0)
    channels, width, lengths = 6, 4, [9, 2, 0, 5]
    t = sum(lengths) + 3  # padding rows after
    x = rng.randn(t, channels).astype(np.float32)
    weight = rng.randn(channels, width).astype(np.float32)
    bias = rng.randn(channels).astype(np.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    zeros = jnp.zeros((len(lengths), width - 1, channels))
    y, final = conv1d.causal_conv1d(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(bias), cu, zeros)
    for s, n in enumerate(lengths):
        rows = x[int(cu[s]):int(cu[s]) + n]
        if n:  # (torch takes no empty input; the empty sequence's state is checked below)
            conv = torch.nn.functional.conv1d(torch.tensor(rows.T[None]), torch.tensor(weight[:, None]),
                                              torch.tensor(bias), padding=width - 1, groups=channels)[0, :, :n]
            np.testing.assert_allclose(np.asarray(y[int(cu[s]):int(cu[s]) + n]),
                                       torch.nn.functional.silu(conv).T.numpy(), rtol=1e-5, atol=1e-5)
        padded = np.concatenate([np.zeros((width - 1, channels), np.float32), rows])
        np.testing.assert_array_equal(np.asarray(final[s]), padded[-(width - 1):])
    np.testing.assert_array_equal(np.asarray(y[sum(lengths):]), 0.0)
    # Sequence 0 again in two calls, then token by token from its state: the same outputs.
    first, mid = conv1d.causal_conv1d(jnp.asarray(x[:4]), jnp.asarray(weight), jnp.asarray(bias),
                                      jnp.asarray([0, 4], jnp.int32), zeros[:1])
    second, end = conv1d.causal_conv1d(jnp.asarray(x[4:9]), jnp.asarray(weight), jnp.asarray(bias),
                                       jnp.asarray([0, 5], jnp.int32), mid)
    np.testing.assert_allclose(np.concatenate([first, second]), np.asarray(y[:9]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(end), np.asarray(final[:1]))
    state, steps = zeros[:1], []
    for i in range(9):
        out, state = conv1d.causal_conv1d_step(jnp.asarray(x[i:i + 1]), jnp.asarray(weight), jnp.asarray(bias), state)
        steps.append(out[0])
    np.testing.assert_allclose(np.stack(steps), np.asarray(y[:9]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(final[:1]))
