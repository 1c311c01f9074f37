"""Checkpoints: saving and publishing through DCP, the global boxes they hold, finding, checking and resuming them."""
