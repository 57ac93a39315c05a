"""PPO's critic: a transformer body with a scalar value head on every position.

The body is a Hugging Face base model (the causal LM without its LM head). By default it
starts from the actor's own weights (the value head on the actor's architecture);
`--critic-load` names another model dir, or a critic saved by a checkpoint. The head starts
at zero, so the first values are 0 and the first advantages are the plain returns.

Saved as `{dir}/` = the body in Hugging Face format + `value_head.safetensors`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from millstream.common.errors import MillstreamError

HEAD_FILE = "value_head.safetensors"


class ValueModel(torch.nn.Module):
    def __init__(self, body: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        """values_BS: the value of the state after each position's token."""
        hidden_BSH = self.body(**inputs).last_hidden_state
        return self.head(hidden_BSH.to(self.head.weight.dtype)).squeeze(-1)

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        self.body.save_pretrained(directory, safe_serialization=True)
        save_file(
            {k: v.contiguous() for k, v in self.head.state_dict().items()}, directory / HEAD_FILE
        )

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file, load_model

        load_model(self.body, str(directory / "model.safetensors"), strict=False)
        self.head.load_state_dict(load_file(directory / HEAD_FILE))


def load_value_model(path: str | Path) -> ValueModel:
    """A critic from a model dir (fresh head) or a saved critic (its head too)."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    path = Path(path)
    if not (path / "config.json").is_file():
        raise MillstreamError(
            f"{path} is not a Hugging Face model dir (no config.json): check --critic-load"
        )
    body = AutoModel.from_pretrained(path, dtype=torch.float32)
    body.config.use_cache = False
    critic = ValueModel(body, body.config.hidden_size)
    if (path / HEAD_FILE).is_file():
        critic.head.load_state_dict(load_file(path / HEAD_FILE))
    return critic
