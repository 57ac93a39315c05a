"""The inference engine (service: engine): speaks SGLang's HTTP API so it and real SGLang are
interchangeable. It runs on the CPU or one GPU (model_runner.py), decodes every running
sequence as one batch over a dynamic KV cache (kv_batch.py, the CPU's) or a static one with
CUDA graphs (kv_pool.py, a GPU's), and serves the trainer's weight updates and memory release
(control_api.py, weights.py)."""
