"""Reward workers: {run}:generated -> {run}:scored, one terminal verdict per group. Imports no torch."""
