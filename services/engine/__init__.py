"""The inference engine (service: engine): speaks SGLang's HTTP API so it and real SGLang are
interchangeable. It runs on the CPU or one GPU (model_runner.py), keeps every request's keys in
one token pool (token_pool.py) with a prefix cache (prefix_cache.py), decodes every running
sequence as one batch that attends to each row's own tokens (paged_batch.py,
paged_attention.py; CUDA graphs on a GPU: decode_graphs.py), and serves the trainer's weight
updates and memory release (control_api.py, weights.py). host.py builds a step's small host
tensors."""
