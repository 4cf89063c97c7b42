"""Ops that models call. Each op folder holds a plain-jnp reference (the semantic truth) and a
dispatcher that picks an implementation by platform; GPU kernels plug in behind the same signature."""
