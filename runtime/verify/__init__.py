"""verify: a plan against the single-process reference (same seed, data and optimizer), its reference loss, the full tensors it gathers, the world it spawns, tolerances and report."""
