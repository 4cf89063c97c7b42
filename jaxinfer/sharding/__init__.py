"""Sharding: the logical axes layers declare, the rule table mapping them to a mesh (``plan``), the
local view layers compute in (``local``), and the per-device forward (``forward``)."""

from jaxinfer.sharding.plan import ShardingPlan, make_mesh

__all__ = ["ShardingPlan", "make_mesh"]
