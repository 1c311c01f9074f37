"""The pipeline executor: one rank's precomputed message steps and actions for every schedule style, its receive buffers, step loss and split backward."""
