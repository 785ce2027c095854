"""The pipeline composition API: stages joined by bounded object-ref queues, scheduling,
metrics and the run report."""
