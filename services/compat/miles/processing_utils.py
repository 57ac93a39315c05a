"""Miles' `miles.utils.processing_utils`: tokenizer and processor loading, images for the engine.

`load_tokenizer` is transformers' AutoTokenizer, once per (path, chat template, arguments) in
a process; `chat_template_path` replaces the model's chat template with the file's.
`load_processor` is None unless the model has a multimodal processor (a text model's
AutoProcessor is its tokenizer: None, as in Miles). transformers, PIL and qwen_vl_utils load
when first used, never at import. Miles' fixes for particular checkpoints (transformers v5
tokenizer components, DeepSeek/Inkling processors and HF config aliases) are not here.
"""

from __future__ import annotations

import base64
import inspect
import io
import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "build_processor_kwargs",
    "call_processor",
    "encode_image_for_rollout_engine",
    "extract_multimodal_train_inputs",
    "load_processor",
    "load_tokenizer",
    "process_vision_info",
]

log = logging.getLogger(__name__)

# the image patch size when the processor names none (Qwen2.5-VL's; Qwen3-VL uses 16)
DEFAULT_PATCH_SIZE = 14

_TOKENIZERS: dict[tuple, Any] = {}


def load_tokenizer(name_or_path: str, chat_template_path: str | None = None, **kwargs: Any) -> Any:
    """AutoTokenizer for `name_or_path`, cached per process; with chat_template_path, that
    file is its chat template."""
    try:
        key: tuple | None = (name_or_path, chat_template_path, tuple(sorted(kwargs.items())))
        hash(key)
    except TypeError:
        key = None  # unhashable arguments: not cached
    if key is not None and key in _TOKENIZERS:
        return _TOKENIZERS[key]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    if chat_template_path:
        if not os.path.isfile(chat_template_path):
            raise FileNotFoundError(
                f"chat_template_path {chat_template_path} not found on this machine"
            )
        with open(chat_template_path, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if key is not None:
        _TOKENIZERS[key] = tokenizer
    return tokenizer


def load_processor(name_or_path: str, **kwargs: Any) -> Any:
    """The model's multimodal processor, or None (no processor, or only a tokenizer)."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as err:
        log.info("no processor for %s: %s", name_or_path, err)
        return None
    if isinstance(processor, PreTrainedTokenizerBase) or not isinstance(processor, ProcessorMixin):
        return None
    return processor


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """The processor's keyword arguments: token ids as lists, media outputs as tensors."""
    kwargs = dict(multimodal_inputs) if multimodal_inputs else {}
    kwargs["text_kwargs"] = {**kwargs.get("text_kwargs", {}), "return_tensors": None}
    for key in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        kwargs[key] = {**kwargs.get(key, {}), "return_tensors": "pt"}
    return kwargs


def _takes_medias(processor: Any) -> bool:
    try:
        params = inspect.signature(processor).parameters
    except (TypeError, ValueError):
        return hasattr(processor, "media_processor")
    return "medias" in params and "text" in params


def call_processor(processor: Any, text: Any, multimodal_inputs: dict | None = None) -> Any:
    """The processor's output for `text` and its images/videos (Kimi-style processors take
    them as one `medias` list)."""
    multimodal_inputs = multimodal_inputs or {}
    if _takes_medias(processor):
        medias = [{"type": "image", "image": x} for x in multimodal_inputs.get("images") or []]
        medias += [{"type": "video", "video": x} for x in multimodal_inputs.get("videos") or []]
        return processor(text=text, medias=medias)
    return processor(text=text, **build_processor_kwargs(multimodal_inputs))


def extract_multimodal_train_inputs(processor_output: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the trainer needs of the processor's output besides the token ids, or None."""
    skip = {"input_ids", "attention_mask", "mm_token_type_ids"}
    return {k: v for k, v in processor_output.items() if k not in skip} or None


def process_vision_info(prompt: Any, processor: Any) -> dict[str, Any]:
    """The images and videos of a chat prompt, as the processor wants them."""
    if hasattr(processor, "extract_media"):
        return processor.extract_media(prompt)
    from qwen_vl_utils import process_vision_info as qwen_process_vision_info

    patch_size = getattr(processor.image_processor, "patch_size", DEFAULT_PATCH_SIZE)
    images, videos = qwen_process_vision_info(prompt, image_patch_size=patch_size)
    return {"images": images, "videos": videos}


def encode_image_for_rollout_engine(image: Any) -> str:
    """A PIL image as the engine takes it: an RGB PNG in a base64 data URL."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
