"""The router: an HTTP proxy in front of inference engines (DESIGN.md section 3). Imports no torch."""
