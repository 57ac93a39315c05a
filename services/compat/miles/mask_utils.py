"""Miles' `miles.utils.mask_utils`: token ids and loss mask of a multi-turn chat, per message.

`MultiTurnLossMaskGenerator(tokenizer, tokenizer_type).get_loss_mask(messages, tools)` returns
(token_ids, loss_mask): the chat template's tokens of every message in turn, with 1 on the
assistant messages' tokens past their header, 0 elsewhere (a message with `step_loss_mask`
other than 1 is all 0). How the template is cut into messages, as Miles' does:

* "qwen": each message templated alone; after the first, the default system prompt the
  template puts in front of every conversation (measured once on a probe conversation) is cut
  off. A tokenizer with DeepSeek-distill's `<｜Assistant｜>` token is read as "distill_qwen".
* "qwen3": each message templated between probe user turns and cut out of them (Qwen3's
  template renders a message differently at the end of a conversation).
* "distill_qwen": the first message as the prompt (with the generation prompt) and the last
  message's text as the whole response.

The assistant header (`<|im_start|>assistant\n` in ChatML) is as long as the generation prompt.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MultiTurnLossMaskGenerator", "get_response_lengths"]

_PROBE = "FOR TESTING ONLY"
_PREFIX_PROBE = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """Per mask, the tokens from its first 1 to its end (0 when it has no 1)."""
    return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]


def _find_all(haystack: list[int], needle: list[int]) -> list[int]:
    n = len(needle)
    return [i for i in range(len(haystack) - n + 1) if haystack[i : i + n] == needle]


class MultiTurnLossMaskGenerator:
    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen"):
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.system_message_length, self.gen_token_length = self.get_system_message_length()

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    def find_all_sublist_indices(self, main_list: list[int], sublist: list[int]) -> list[int]:
        return _find_all(main_list, sublist)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _template(self, messages: list[dict], **kwargs: Any) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        )

    def get_system_message_length(self) -> tuple[int, int]:
        """(tokens of the default system prompt the template puts first, tokens of the
        generation prompt), measured on two identical user turns: whatever comes before the
        first turn's text beyond one turn's own header is the system prompt."""
        text_ids = self._ids(_PROBE)
        probe = [{"role": "user", "content": _PROBE}] * 2
        rendered = self.tokenizer.apply_chat_template(
            probe, add_special_tokens=False, tokenize=False
        )
        ids = self._ids(rendered)
        first, second = _find_all(ids, text_ids)[:2]
        tail = len(ids) - len(text_ids) - second  # a turn's closing tokens
        header = (second - first) - tail - len(text_ids)  # a turn's opening tokens
        with_gen = self._template(probe, add_special_tokens=False, add_generation_prompt=True)
        return first - header, len(with_gen) - len(ids)

    def _mask(self, message: dict, ids: list[int]) -> list[int]:
        if message.get("step_loss_mask", 1) != 1 or message["role"] != "assistant":
            return [0] * len(ids)
        return [0] * self.gen_token_length + [1] * (len(ids) - self.gen_token_length)

    def _per_message(self, messages: list[dict], render: Any) -> tuple[list[int], list[int]]:
        token_ids: list[int] = []
        loss_mask: list[int] = []
        for i, message in enumerate(messages):
            ids = render(i, message)
            if i > 0 and message["role"] != "system":
                ids = ids[self.system_message_length :]
            token_ids += ids
            loss_mask += self._mask(message, ids)
        return token_ids, loss_mask

    def gen_multi_turn_loss_mask_qwen(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        def render(i: int, message: dict) -> list[int]:
            return self._template([message], **({"tools": tools} if i == 0 else {}))

        return self._per_message(messages, render)

    def gen_multi_turn_loss_mask_qwen3(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        prefix = self._template([_PREFIX_PROBE])

        def render(i: int, message: dict) -> list[int]:
            if i == 0:
                return self._template([message, _PREFIX_PROBE], tools=tools)[: -len(prefix)]
            return self._template([_PREFIX_PROBE, message])[len(prefix) :]

        return self._per_message(messages, render)

    def gen_multi_turn_loss_mask_distill_qwen(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        prompt = self.tokenizer.apply_chat_template(
            messages[:1], tokenize=False, add_generation_prompt=True, tools=tools
        )
        prompt_ids = self._ids(prompt)
        response_ids = self._ids(messages[-1]["content"])
        token_ids = prompt_ids + response_ids
        if messages[-1].get("step_loss_mask", 1) != 1:
            return token_ids, [0] * len(token_ids)
        return token_ids, [0] * len(prompt_ids) + [1] * len(response_ids)

    def get_loss_mask(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        kind = self.tokenizer_type
        if kind == "qwen" and "<｜Assistant｜>" in self.tokenizer.get_added_vocab():
            kind = "distill_qwen"
        make = {
            "qwen": self.gen_multi_turn_loss_mask_qwen,
            "qwen3": self.gen_multi_turn_loss_mask_qwen3,
            "distill_qwen": self.gen_multi_turn_loss_mask_distill_qwen,
        }.get(kind)
        if make is None:
            raise ValueError(f"Unsupported tokenizer type: {self.tokenizer_type}")
        return make(messages, tools)

    def get_loss_mask_with_multimodal_alignment(
        self, messages: list[dict], input_ids: list[int], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """The loss mask of the messages' text, right-aligned to the processor's input_ids
        (media tokens come before the text they belong to, never inside an answer)."""
        text_messages = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = [
                    item.get("text", "") if isinstance(item, dict) else item
                    for item in content
                    if isinstance(item, str)
                    or (isinstance(item, dict) and item.get("type") == "text")
                ]
                message = {"role": message["role"], "content": " ".join(parts)}
            text_messages.append(message)
        _, text_mask = self.get_loss_mask(text_messages, tools=tools)
        extra = len(input_ids) - len(text_mask)
        if extra < 0:
            raise ValueError(
                f"input_ids ({len(input_ids)}) are shorter than the text's loss mask "
                f"({len(text_mask)}): the processor and the tokenizer tokenize differently"
            )
        return input_ids, [0] * extra + text_mask

    def get_text_from_loss_mask(self, token_ids: list[int], loss_masks: list[int]) -> list[str]:
        """The decoded text of every run of 1s in the mask."""
        texts: list[str] = []
        run: list[int] = []
        for token, mask in zip(token_ids, loss_masks, strict=False):
            if mask == 1:
                run.append(token)
            elif run:
                texts.append(self.tokenizer.decode(run))
                run = []
        if run:
            texts.append(self.tokenizer.decode(run))
        return texts
