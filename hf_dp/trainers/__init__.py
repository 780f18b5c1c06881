"""trainers."""
