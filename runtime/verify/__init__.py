"""verify: a plan against the single-process reference (same seed, data and optimizer), its reference loss, tolerances and report."""
