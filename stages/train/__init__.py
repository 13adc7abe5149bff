"""Training internals: the plan's probe (autotune), what its decisions do to a model
(settings), the shared trainer set-up, and one module per training method (sft)."""
