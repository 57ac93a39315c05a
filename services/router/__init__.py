"""The router: an HTTP proxy in front of inference engines (docs/architecture.md). Imports no torch."""
