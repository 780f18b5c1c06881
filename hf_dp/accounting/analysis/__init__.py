"""Pure privacy math (no state): one module per accountant."""
