"""The engine's HTTP surface (service: engine; layer http, above scheduling): SGLang's API and
OpenAI's, on FastAPI, over the EngineCore (core.py).

| file | what it holds | imports from the engine |
| --- | --- | --- |
| `api.py` | the app: /generate, the info endpoints, /metrics, the error shape, the routers below | control, generation, openai, protocol; core, prom, scheduler |
| `openai.py` | /v1/models, /v1/completions, /v1/chat/completions | generation, protocol; core, scheduler, sequence |
| `control.py` | the admin endpoints: abort, pause/continue, flush, memory release/resume, weight updates, the admin token and fencing | protocol; core, scheduler, weights |
| `protocol.py` | the request bodies of the native endpoints, as strict pydantic models | nothing |
| `generation.py` | a /generate body to Sequences and back to SGLang's output, streaming | protocol; core, sampling, scheduler, sequence |
| `registration.py` | --register-with (a router) and --coordinator (the trainer's JoinEngine) | nothing |

May import: the scheduling modules, executor, kv, quant. Never main.
"""
