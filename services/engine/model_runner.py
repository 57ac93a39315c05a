"""Load a Hugging Face model directory and run the forward passes the scheduler needs.

Device: `--device auto` puts the model on the GPU torch sees (else the CPU), in bfloat16 on a
GPU and float32 on the CPU unless `--dtype` says otherwise. Every input tensor is made on the
model's device; sampling runs there too (sampling.py), and only the sampled ids and their
logprobs come back to the host.

Loading is local only (`local_files_only=True`): a missing or incomplete directory is an
error that names the path, never a download. The model is put in eval mode with gradients
off; the scheduler thread runs every forward under `torch.inference_mode`.

Only full-attention decoders are supported: the running batch moves a row's cached tokens
between cache columns (kv_batch.py), which sliding-window caches do not allow.

A checkpoint whose config.json has an FP8 quantization_config is served in FP8: its quantized
Linears hold the e4m3 weights and block scales (fp8.py); `quantization` says "fp8".
"""

from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path
from typing import Any

import torch

from millstream.common.errors import MillstreamError

from . import fp8

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`--device`: auto is the GPU torch sees, else the CPU; cuda without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MillstreamError(
            f"--device {name}: torch sees no GPU here (a CPU build of torch, or "
            "CUDA_VISIBLE_DEVICES hides them); use --device cpu"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> str:
    """`--dtype auto`: bfloat16 on a GPU (SGLang's default for bf16 checkpoints), float32 on
    the CPU (bf16 matmuls are slower than fp32 on most CPUs)."""
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cuda" else "float32"


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token takes in the KV cache: keys and values of every layer."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * itemsize


def kv_token_budget(
    config: Any, dtype: torch.dtype, device: torch.device, mem_fraction: float
) -> int:
    """SGLang's --mem-fraction-static on `device`: of the GPU's memory, `mem_fraction` is for
    the weights plus the static KV cache; what the loaded weights (and anything else this
    process holds) leave of that share is the cache, in tokens."""
    total = torch.cuda.get_device_properties(device).total_memory
    used = torch.cuda.memory_allocated(device)
    # Never more than the GPU has free now: another process (a colocated trainer) may hold
    # part of it; a tenth of that stays free for activations and the CUDA graphs.
    free_now = int(torch.cuda.mem_get_info(device)[0] * 0.9)
    free = min(int(total * mem_fraction) - used, free_now)
    if free <= 0:
        raise MillstreamError(
            f"--mem-fraction-static {mem_fraction}: the weights already take "
            f"{used / 2**30:.1f} GiB of the {total * mem_fraction / 2**30:.1f} GiB it allows on "
            f"{torch.cuda.get_device_name(device)}; raise it"
        )
    return free // kv_bytes_per_token(config, dtype)


def cache_kwarg(model: Any) -> str:
    """The model forward's name for the KV cache: `cache` from transformers 5.24 on (where
    `past_key_values` still works but warns, once per call site), `past_key_values` before."""
    return _cache_kwarg(type(model))


@functools.cache
def _cache_kwarg(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class ModelRunner:
    """The model, its tokenizer, and the prefill forward (decode lives in RunningBatch)."""

    def __init__(
        self, model_path: str, dtype: str = "float32", device: str = "cpu", fp8_gemm: str = "auto"
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
        from transformers.utils import logging as hf_logging

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise MillstreamError(
                f"--model-path {model_path}: no config.json there; "
                "pass a Hugging Face model directory (config, safetensors, tokenizer files)"
            )
        hf_logging.disable_progress_bar()
        self.model_path = str(path)
        self.device = resolve_device(device)
        dtype = resolve_dtype(dtype, self.device)
        self.dtype = DTYPES[dtype]
        fp8_block = fp8.read_block(path)
        self.quantization = "fp8" if fp8_block else None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            if fp8_block:
                model = fp8.load_model(model_path, self.dtype, fp8_block)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    path, local_files_only=True, dtype=self.dtype
                )
        except OSError as err:
            raise MillstreamError(f"--model-path {model_path}: cannot load: {err}") from err
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.fp8_gemm: str | None = None  # how the FP8 Linears compute (fp8.py); None: not FP8
        if fp8_block:
            self.fp8_gemm = fp8.choose_gemm(fp8_gemm, self.device)
            counts = fp8.set_gemm(self.model, self.fp8_gemm)
            fp8.probe_scaled_mm(self.model, self.device, self.dtype)
            log.info("FP8 Linears in 128x128 blocks, computed by %s", counts)
        self._cache_class = DynamicCache
        probe = DynamicCache(config=self.model.config)
        if any(getattr(layer, "is_sliding", False) for layer in probe.layers):
            raise MillstreamError(
                f"--model-path {model_path}: sliding-window attention is not supported by "
                "the CPU engine (it needs a full-attention decoder)"
            )
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.vocab_size = int(self.model.config.vocab_size)
        log.info(
            "loaded %s (%s on %s, %.1fM parameters, vocab %d, eos %s)",
            path,
            dtype,
            self.device,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            self.vocab_size,
            sorted(self.eos_token_ids),
        )

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.model.state_dict().values())

    def release_weights(self) -> int:
        """Move the weights to host memory, freeing the GPU's (nothing moves on the CPU);
        returns the bytes freed. Parameters keep their identity (`Module.to` swaps their
        data), so the weight loader's references stay valid and an update that arrives
        while released lands in the host copy."""
        if self.device.type == "cpu":
            return 0
        self.model.to("cpu")
        return self.weight_bytes

    def resume_weights(self) -> int:
        """The weights back on the device; returns the bytes moved."""
        if self.device.type == "cpu":
            return 0
        self.model.to(self.device)
        return self.weight_bytes

    def empty_device_cache(self) -> None:
        """Hand freed GPU memory back to the driver, so another process can have it."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def new_cache(self) -> Any:
        return self._cache_class(config=self.model.config)

    @torch.inference_mode()
    def prefill(
        self, prefixes: list[list[int]], logits_to_keep: int = 1
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Prefill prefixes together in one forward, left-padded to the longest.

        Returns (cache, mask_BT marking real columns, logits_BKV at each row's last
        K = `logits_to_keep` positions; [:, -1] is the next-token distribution). Rows are
        right-aligned, so those positions are real for every row; a padded row gets its true
        positions (position_ids) and padding keys are masked, so its logits equal those of
        the row alone up to float summation order. Pad columns of the cache are zeroed (a
        query that sees only padding can come out NaN, and 0 x NaN would leak through the
        mask later). The model's own forward keeps only the K positions (transformers'
        `logits_to_keep`), so the LM head runs on K positions, not the whole prefix."""
        width = max(len(p) for p in prefixes)
        assert 1 <= logits_to_keep <= min(len(p) for p in prefixes), (
            f"logits_to_keep {logits_to_keep} of {sorted({len(p) for p in prefixes})}"
        )
        input_ids_BT = torch.zeros(len(prefixes), width, dtype=torch.long)
        mask_BT = torch.zeros(len(prefixes), width, dtype=torch.long)
        for b, prefix in enumerate(prefixes):
            input_ids_BT[b, width - len(prefix) :] = torch.tensor(prefix)
            mask_BT[b, width - len(prefix) :] = 1
        input_ids_BT = input_ids_BT.to(self.device, non_blocking=True)
        mask_BT = mask_BT.to(self.device, non_blocking=True)
        padded = bool((mask_BT == 0).any())
        cache = self.new_cache()
        out = self.model(
            input_ids=input_ids_BT,
            attention_mask=mask_BT if padded else None,
            position_ids=(mask_BT.cumsum(-1) - 1).clamp_(min=0) if padded else None,
            use_cache=True,
            **{cache_kwarg(self.model): cache},
            logits_to_keep=logits_to_keep,
        )
        if padded:
            pad_B1T1 = (mask_BT == 0)[:, None, :, None]
            for layer in cache.layers:
                layer.keys.masked_fill_(pad_B1T1, 0.0)
                layer.values.masked_fill_(pad_B1T1, 0.0)
        return cache, mask_BT, out.logits[:, -logits_to_keep:, :]
