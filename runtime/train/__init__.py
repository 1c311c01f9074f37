"""Training of one rank: the step (trainer), the loop, the optimizer and its schedule, evaluation, metrics, traces, memory traces and cost profiles."""
