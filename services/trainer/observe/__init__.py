"""What a run shows while it goes and after: the trainer's side of observability (docs/observability.md).

Owns the stdout row and metrics.jsonl with their tensorboard/wandb mirrors (`metrics`), Miles'
custom log functions (`log_hooks`), torch.profiler windows (`profiler`), the Prometheus
metrics (`prom`), the stall watch that keeps every wait loud and where a stop ends the loop
(`watch`), metrics.jsonl read across resumes (`history`), summary.json on every exit
(`summary`), a finished run not trained again when started again (`finished`), a crashing plugin's traceback and the stop after too many such groups (`plugin_failures`) and `millstream plot` (`plot`). Nothing here changes what is trained.
"""
