"""d9d-core: the distributed core of d9d (topology, distributed ops, pytrees, determinism) and test support."""
