"""The inference engine (service: engine): millstream's own server speaking SGLang's HTTP API,
so it and a real SGLang server are interchangeable; on the CPU or one GPU.

Layers, lowest first: quant < kv < executor < scheduling < http < main. A module imports its
own layer and the layers below it, never one above (tests/unit/repo/test_layout.py checks every
import with ast). Each folder's __init__ lists its files. Paths in the engine's docstrings
are relative to engine/.

| layer | where | what it holds | may import |
| --- | --- | --- | --- |
| quant | `quant/` | FP8 checkpoints: the block-wise e4m3 cast, FP8 Linears, their GEMMs | nothing of the engine |
| kv | `kv/` | every request's keys and values: `sizing.py` (every budget of the pool), the token pool, the prefix cache over its pages | quant |
| executor | `executor/` | the model on its device (`model_runner.py`), attention over the pool's pages, the decode step's CUDA graphs, a step's host tensors | quant, kv |
| scheduling | `*.py` here but main.py | the flags (`config.py`), the components built from them (`core.py`: the running batch as the flags size it), the scheduler thread (`scheduler.py`), the running batch (`paged_batch.py`), packed prefills (`prefill.py`), sampling (`sampling.py`), sequences (`sequence.py`), weight updates (`weights.py`), Prometheus metrics (`prom.py`) | quant, kv, executor |
| http | `http/` | the FastAPI app: SGLang's native endpoints, OpenAI's, the admin (control) endpoints, the request models, /generate bodies to sequences and back, joining a router | every layer below |
| main | `main.py` | `millstream engine`: parse the flags, set up tracing, load, serve, clean up | every layer |

`--max-total-tokens` (and `--mem-fraction-static`) go main.py -> config.py -> core.py
`new_batch` -> kv/sizing.py `pool_size` -> kv/token_pool.py, and nowhere else.
"""
