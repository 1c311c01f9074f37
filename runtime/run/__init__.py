"""Starting and ending a run: the launcher over torchrun, the run directory and its lock, the worker's lifetime, failure handling and the hang watchdog."""
