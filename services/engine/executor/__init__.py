"""The model's forward passes (service: engine; layer executor, above quant and kv): the model on
its device, and attention that reads each row's own tokens from the pool.

| file | what it holds | imports from the engine |
| --- | --- | --- |
| `model_runner.py` | the model and tokenizer loaded from a directory, on its device and dtype; releasing and resuming the weights | quant |
| `paged_attention.py` | attention over the token pool's slots, rows grouped by length (the step's plan) | nothing |
| `decode_graphs.py` | the decode step captured in CUDA graphs, per batch size and context bucket | paged_attention, kv |
| `host.py` | a step's small host tensors, built through numpy | nothing |

May import: quant, kv. Never the scheduling modules, http or main.
"""
