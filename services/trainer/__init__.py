"""The trainer: data source, admission, buffer reader, algorithms, backends, checkpoints and
the coordinator (DESIGN.md sections 1, 4, 5, 6). Rank 0 hosts the Coordinator gRPC service."""
