"""Meshes and the partitioning of parameters over them."""

from jaxinfer.sharding.mesh import make_mesh, param_sharding, replicated

__all__ = ["make_mesh", "param_sharding", "replicated"]
