"""The KV cache (service: engine; layer kv, above quant): where every request's keys and
values live, SGLang's srt/mem_cache in small, with the sizing kept apart.

| file | what it holds | imports from the engine |
| --- | --- | --- |
| `sizing.py` | every budget of the pool: bytes a token, what --mem-fraction-static leaves on a GPU, the CPU's start and limit (`CPU_*`), `pool_size` (--max-total-tokens), DEFAULT_MEM_FRACTION | nothing |
| `token_pool.py` | the token pool: one slot a token, handed out a page at a time (SGLang's token_to_kv_pool with its paged allocator) | sizing |
| `prefix_cache.py` | the prefix cache: whole pages of finished or retracted rows kept for the next request that starts the same way (SGLang's radix cache, in pages) | token_pool |

May import: quant. Never executor, the scheduling modules, http or main.
"""
