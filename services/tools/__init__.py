"""Command-line tools over a run's files and the repository, no service's: `trace_cli`
(`millstream trace`: a run's traces summarised) and `protogen` (`make protos`: the Python code
for protos/ into common/pb/). They import only `common`.
"""
