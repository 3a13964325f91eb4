"""Shared by the adapter tests: tiny models of every kind, the peft/loragen adapter cases, factories."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import peft
import torch
from torch import nn

from loragen import LoraConfig, get_lora_model, save_adapter
from tests.conftest import TINY_MODELS, tiny_inputs

WEIGHTS = "adapter_model.safetensors"


class ConvNet(nn.Module):
    """A non-transformers model with every layer type loragen adapts (Conv1D aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.conv1 = nn.Conv1d(8, 12, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 6, 3, stride=2)
        self.head = nn.Linear(6, 4)

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        text = self.conv1(self.emb(ids).transpose(1, 2)).mean(dim=(1, 2))  # (N,)
        return self.head(self.conv2(image).mean(dim=(2, 3))) + text[:, None]  # (N, 4)


MODELS: dict[str, Callable[[], nn.Module]] = {**TINY_MODELS, "convnet": ConvNet}

# case -> (model kind, LoraConfig / peft.LoraConfig keyword arguments)
CASES: dict[str, tuple[str, dict]] = {
    "llama-patterns-rslora": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
            rank_pattern={"layers.0.self_attn.q_proj": 2},
            alpha_pattern={"v_proj": 3},
        ),
    ),
    "llama-embedding-modules-to-save": (
        "llama",
        dict(r=4, target_modules=["embed_tokens", "q_proj"], modules_to_save=["lm_head"]),
    ),
    "gpt2-conv1d-bias": ("gpt2", dict(r=4, target_modules=["c_attn", "c_proj", "c_fc"], bias="lora_only")),
    "bert-modules-to-save": (
        "bert",
        dict(r=4, lora_alpha=16, target_modules=["query", "value"], modules_to_save=["classifier"]),
    ),
    "t5-embedding": ("t5", dict(r=4, target_modules=["q", "v", "shared"])),
    "bert-bias-all": ("bert", dict(r=4, target_modules=["query", "value"], bias="all")),
    "t5-bias-all": ("t5", dict(r=4, target_modules=["q", "v"], bias="all")),
    "convnet": ("convnet", dict(r=2, lora_alpha=4, target_modules=["emb", "conv1", "conv2", "head"])),
}


def make_model(kind: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The same freshly initialised model for the same ``kind`` every time."""
    torch.manual_seed(0)
    return MODELS[kind]().eval().to(dtype)


def model_inputs(kind: str) -> dict[str, torch.Tensor]:
    if kind == "convnet":
        g = torch.Generator().manual_seed(0)
        return {
            "ids": torch.randint(0, 20, (2, 5), generator=g),
            "image": torch.randn(2, 3, 9, 9, generator=g),
        }
    return tiny_inputs(kind)


@torch.no_grad()
def run_model(model: nn.Module, kind: str) -> torch.Tensor:
    out = model(**model_inputs(kind))
    return out if isinstance(out, torch.Tensor) else out.logits


@torch.no_grad()
def perturb_trainable(model: nn.Module, seed: int) -> None:
    """Move every trainable parameter (LoRA factors, modules to save, biases) off its initial value."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.add_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))


def peft_adapter(kind: str, kwargs: dict, folder: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A trained-looking peft adapter for ``kind`` saved in ``folder``; returns the peft model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(
            make_model(kind, dtype), peft.LoraConfig(**kwargs), autocast_adapter_dtype=dtype == torch.float32
        )
        perturb_trainable(model, seed=1)
        model.save_pretrained(str(folder))
    return model.eval()


def loragen_adapter(kind: str, kwargs: dict, folder: Path) -> nn.Module:
    """A trained-looking loragen adapter for ``kind`` saved in ``folder``; returns the loragen model."""
    model = get_lora_model(make_model(kind), LoraConfig(**kwargs))
    perturb_trainable(model, seed=2)
    save_adapter(model, folder)
    return model


def model_state(model: nn.Module) -> dict:
    """Everything load_adapter could change: tensors, module types, requires_grad, the stored config."""
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "types": {name: type(m) for name, m in model.named_modules()},
        "grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "config": model.__dict__.get("loragen_config"),
    }


def assert_same_state(model: nn.Module, before: dict) -> None:
    after = model_state(model)
    assert after["types"] == before["types"]
    assert after["grad"] == before["grad"]
    assert after["config"] is before["config"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for key, value in before["tensors"].items():
        assert torch.equal(after["tensors"][key], value), key


def tree_snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (links not followed): path -> file bytes, link target, or "<dir>"."""
    snapshot: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_symlink():
            snapshot[relative] = ("link", str(path.readlink()))
        elif path.is_dir():
            snapshot[relative] = "<dir>"
        else:
            snapshot[relative] = path.read_bytes()
    return snapshot


class TinyNet(nn.Module):
    """Two square Linear layers: the smallest model with an adapter to save and a checkpoint to merge."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.v = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(torch.relu(self.q(x)))  # (N, 4)


def tiny_lora(seed: int = 0) -> nn.Module:
    """A :class:`TinyNet` with LoRA on both layers and non-zero B factors (so merging changes weights)."""
    torch.manual_seed(seed)
    model = get_lora_model(TinyNet(), LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v"]))
    perturb_trainable(model, seed)
    return model


def main(argv: list[str]) -> int:
    """``loragen ARGV`` through the real entry point; returns its exit status."""
    from loragen import cli

    return cli.main(argv)


def save_checkpoint(model: nn.Module, folder: Path, sharded: bool) -> Path:
    """``model``'s weights as transformers writes them: one file, or shards with an index."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(folder), max_shard_size="40KB" if sharded else "10GB")
    return folder if sharded else folder / "model.safetensors"
