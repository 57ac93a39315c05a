"""millstream: disaggregated RL post-training for LLMs. See DESIGN.md and README.md."""

__version__ = "0.1.0"
