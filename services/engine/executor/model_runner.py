"""Load a Hugging Face model directory and run the forward passes the scheduler needs.

Device: `--device auto` puts the model on the GPU torch sees (else the CPU), in bfloat16 on a
GPU and float32 on the CPU unless `--dtype` says otherwise. Every input tensor is made on the
model's device; sampling runs there too (sampling.py), and only the sampled ids and their
logprobs come back to the host.

Loading is local only (`local_files_only=True`): a missing or incomplete directory is an
error that names the path, never a download. The model is put in eval mode with gradients
off; the scheduler thread runs every forward under `torch.inference_mode`.

Only full-attention decoders are supported: attention is the engine's own, over each row's
tokens in the KV token pool (paged_attention.py), with no sliding window.

A checkpoint whose config.json has an FP8 quantization_config is served in FP8: its quantized
Linears hold the e4m3 weights and block scales (quant/fp8.py); `quantization` says "fp8".

Releasing the weights (/release_memory_occupation, for a colocated trainer) discards them, as
SGLang does under torch_memory_saver without its CPU backup: every parameter's `.data` becomes
an empty tensor (each tied parameter once), so its memory goes back to the allocator with no
copy anywhere, on the GPU and on the CPU alike, and the bytes freed are reported. The
Parameter objects stay, so the weight loader's references stay valid. Resuming allocates them
again, uninitialized: their content is garbage until a weight update has written every
parameter, and `weights_valid` stays False until then (the scheduler runs no step meanwhile:
requests queue, as while released). The sync that follows a resume overwrites every weight
anyway, so nothing is lost but the copy GPU -> host -> GPU that keeping them would cost;
/update_weights_from_disk of the checkpoint restores them too. The new storage has new
addresses, so CUDA graphs are captured again after a resume (decode_graphs.py). SGLang keeps the
virtual addresses (torch_memory_saver remaps physical pages under them) so its graphs survive;
that package is not a dependency here, and an allocator swap under the model is not something
`make test` could check on the CPU, so graphs are simply captured again (the capture time is
logged). Buffers (rotary frequencies) are small and stay.

The KV token pool's size is kv/sizing.py's (what --mem-fraction-static leaves once the
weights above are loaded).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from millstream.common.errors import MillstreamError

from ..quant import fp8

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.cache
def _glibc() -> Any:
    """glibc, for malloc_trim; None where malloc is another libc's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc's, not every libc's
    except (OSError, AttributeError):
        return None
    return libc


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
    """The model and its tokenizer; forwards run in the running batch (paged_batch.py)."""

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
        self.fp8_gemm: str | None = (
            None  # how the FP8 Linears compute (quant/fp8.py); None: not FP8
        )
        if fp8_block:
            self.fp8_gemm = fp8.choose_gemm(fp8_gemm, self.device)
            fp8.set_gemm(self.model, self.fp8_gemm)
            counts = fp8.probe_scaled_mm(self.model, self.device, self.dtype)
            log.info("FP8 Linears in 128x128 blocks, computed by %s", counts)
        # Each parameter once (tied ones share one), with its shape: what release frees.
        unique = {id(p): p for p in self.model.parameters()}
        self._shapes = [(p, p.shape) for p in unique.values()]
        self.weights_released = False
        self._unwritten: set[int] = set()  # ids of parameters not written since a resume
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
        """Bytes of the parameters, each tied one once (released or not)."""
        return sum(shape.numel() * p.element_size() for p, shape in self._shapes)

    @property
    def weights_valid(self) -> bool:
        """Whether the parameters hold weights: not released, and written by updates since
        the last resume (module docstring)."""
        return not self.weights_released and not self._unwritten

    @property
    def unwritten_parameters(self) -> int:
        return len(self._unwritten)

    def release_weights(self) -> int:
        """Discard the weights (module docstring); returns the bytes freed."""
        if self.weights_released:
            return 0
        with torch.inference_mode(False):  # plain tensors: an update may run outside it
            for p, _ in self._shapes:
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.weights_released = True
        return self.weight_bytes

    def resume_weights(self) -> int:
        """Allocate the weights again, uninitialized; invalid until updates have written
        every parameter (`note_written`). Returns the bytes allocated."""
        if not self.weights_released:
            return 0
        with torch.inference_mode(False):
            for p, shape in self._shapes:
                p.data = torch.empty(shape, dtype=p.dtype, device=self.device)
        self.weights_released = False
        self._unwritten = {id(p) for p, _ in self._shapes}
        return self.weight_bytes

    def note_written(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """An update wrote `params`; True when that made the weights valid again."""
        if not self._unwritten:
            return False
        self._unwritten.difference_update(id(p) for p in params)
        return not self._unwritten

    def empty_device_cache(self) -> None:
        """Hand freed memory back, so another process (a colocated trainer) can have it: the
        GPU's to the driver; the CPU's to the OS, which glibc would otherwise keep (the
        engine has it keep up to 1 GB: common/heap.py)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif (libc := _glibc()) is not None:
            libc.malloc_trim(0)
