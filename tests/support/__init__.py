"""Helpers the test tiers share: a real redis-server, free ports, a tiny model, processes."""
