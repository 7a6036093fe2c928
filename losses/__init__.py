"""Training objectives, one module per method (pure functions on tensors; no model code)."""
