"""Weight and cache bytes per device of each family's real config at a tensor-parallel size, computed
from the config and the layers' declared partitioning (an abstract ``init``: nothing is allocated,
no device is needed).

    python scripts/bytes_per_device.py --tensor-parallel-size 8 [--enable-expert-parallel] [--json OUT]

The configs are transformers' defaults for each family's config class (its reference model), with
the model named where the defaults are not one (Llama, Qwen3: their largest dense releases).
"""

from __future__ import annotations

import argparse
import json
import math

import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.specs import PoolSizes
from jaxinfer.config import ModelConfig
from jaxinfer.registry import ModelRegistry
from jaxinfer.sharding.for_model import abstract_plan
from jaxinfer.sharding.plan import bytes_per_device
from jaxinfer.tiny import TINY_FAMILIES
from jaxinfer.weights import declared_params

# Models whose config class defaults are not a released model: their released sizes.
RELEASED = {
    "llama": ("Llama-3.1-70B", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)),
    "qwen3": ("Qwen3-32B", dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936)),
}


def family_config(family: str) -> tuple[str, ModelConfig]:
    """(what the config is, the config) for ``family``."""
    tiny = TINY_FAMILIES[family]
    name, sizes = RELEASED.get(family, (f"{tiny['architectures'][0]} defaults", {}))
    raw = {"architectures": tiny["architectures"], "model_type": tiny["model_type"], **sizes}
    return name, ModelConfig.from_dict(raw)


def per_device(family: str, tensor_parallel_size: int, expert_parallel: bool) -> dict:
    name, config = family_config(family)
    model_cls = ModelRegistry.resolve(config.architecture)
    dtype = jnp.bfloat16
    shapes, axes = declared_params(model_cls, config, dtype)
    plan = abstract_plan(model_cls, config, shapes, axes, tensor_parallel_size=tensor_parallel_size,
                         enable_expert_parallel=expert_parallel)
    total = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in shapes.values())
    mine = sum(bytes_per_device(s.shape, s.dtype, axes[path], plan) for path, s in shapes.items())
    cache_token = cache_token_mine = 0
    for specs in model_cls.cache_specs(config):
        for spec in specs:
            if spec.paged:
                for shape, own, logical in spec.arrays(PoolSizes(page_size=1, num_pages=1, num_slots=1)).values():
                    cache_token += math.prod(shape) * np.dtype(own or dtype).itemsize
                    cache_token_mine += bytes_per_device(shape, own or dtype, logical, plan)
    return {"family": family, "config": name, "tensor_parallel_size": tensor_parallel_size,
            "expert_parallel": expert_parallel, "weights_gib": total / 2**30, "weights_per_device_gib": mine / 2**30,
            "split_fraction": 1 - (mine * tensor_parallel_size - total) / (total * (tensor_parallel_size - 1)),
            "cache_kib_per_token": cache_token / 1024, "cache_kib_per_token_per_device": cache_token_mine / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel-size", type=int, default=8)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"{'family':<14}{'config':<36}{'weights GiB':>12}{'per device':>12}{'split':>8}{'cache KiB/tok/dev':>19}")
    for family in sorted(TINY_FAMILIES):
        row = per_device(family, args.tensor_parallel_size, args.enable_expert_parallel)
        rows.append(row)
        print(f"{family:<14}{row['config']:<36}{row['weights_gib']:>12.1f}{row['weights_per_device_gib']:>12.2f}"
              f"{row['split_fraction']:>8.1%}{row['cache_kib_per_token_per_device']:>19.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
