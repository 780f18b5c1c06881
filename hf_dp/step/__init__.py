"""step."""
