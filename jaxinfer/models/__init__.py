"""Model implementations. Look them up through ``jaxinfer.registry.ModelRegistry``."""
