"""Starting and ending a run: the launcher over torchrun and the worker it starts, the run directory and its lock, the worker's lifetime, failure handling and the hang watchdog."""
