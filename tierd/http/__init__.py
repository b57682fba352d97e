"""HTTP endpoints for operators."""
