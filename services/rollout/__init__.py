"""Rollout workers: {run}:prompts -> router -> {run}:generated (docs/architecture.md, step 2)."""
