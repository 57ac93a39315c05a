"""The trainer service: one RL iteration after another (docs/architecture.md).

Top level, the iteration and its parts: `main` (entry), `build` (wiring), `trainer` (the
loop), `admission`, `buffer`, `batch`, `data`, `evaluate`, `teacher`, `janitor`, `preflight`,
`lease` (one trainer per run).
Rooms: `algorithms/` (the objective), `backends/` (the train step: torch, FSDP2, data
parallel, `megatron/`), `weights/` (getting weights to the engines), `observe/` (metrics,
log hooks, profiler, Prometheus, stall watch, plots), `checkpoints/` (save, resume, convert).
The local cluster it may start is the `launch` package's (only `main` and `preflight` import
it); flag checks are the config's.
"""
