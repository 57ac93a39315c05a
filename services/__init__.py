"""millstream: disaggregated RL post-training for LLMs. See README.md and docs/architecture.md."""

__version__ = "0.1.0"
