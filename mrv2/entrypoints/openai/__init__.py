"""The OpenAI-compatible HTTP server (`mrv2 serve`)."""
