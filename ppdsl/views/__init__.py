"""What the CLI shows: the plan report, schedule drawings and measured traces read back."""
