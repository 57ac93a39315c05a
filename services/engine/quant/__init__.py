"""FP8 rollout (service: engine; layer quant, the lowest): block-wise FP8 checkpoints served in
FP8, and full-precision weight updates cast into them (docs/fp8.md).

| file | what it holds | imports from the engine |
| --- | --- | --- |
| `fp8.py` | the checkpoint's quantization_config, the block-wise e4m3 cast, FP8 Linears, loading an FP8 model, --fp8-gemm | fp8_gemm |
| `fp8_gemm.py` | the W8A8 GEMMs of an FP8 Linear (SGLang's block FP8 GEMM), activation quantization | nothing |

May import: nothing else of the engine (every other layer is above it).
"""
