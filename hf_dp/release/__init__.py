"""release."""
