"""Rollout workers: {run}:prompts -> router -> {run}:generated (DESIGN.md section 1, step 2)."""
