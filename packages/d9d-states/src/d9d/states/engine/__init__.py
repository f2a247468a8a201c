"""Plans and their execution: ordering, splitting across ranks, streaming, staged publication."""
