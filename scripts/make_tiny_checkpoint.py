"""Write a tiny random checkpoint in HF format: python scripts/make_tiny_checkpoint.py DIR [--family qwen3]."""

import argparse

from jaxinfer.tiny import TINY_FAMILIES, write_tiny_checkpoint

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--family", default="llama", choices=sorted(TINY_FAMILIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_checkpoint(args.path, args.family, seed=args.seed))
