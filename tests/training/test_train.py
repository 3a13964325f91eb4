"""Training the way users train: accumulation, checkpointing, hybrid LoRA + full training, bf16 autocast."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import loragen
from loragen.convert import find_lora_layers
from loragen.errors import TrainingSetupError
from loragen.training.checkpointing import checkpoint_modules, enable_input_require_grads
from loragen.training.distributed import is_main_process, save_adapter_main_process, unwrap_model, wrap_ddp
from loragen.training.optimizers import make_optimizer


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class TinyLM(nn.Module):
    """Embedding -> residual blocks -> head: the shape of a transformer without attention."""

    def __init__(self, vocab: int = 50, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, width)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, T, vocab)


def _lora_tiny_lm(seed: int = 0, **config: object) -> TinyLM:
    torch.manual_seed(seed)
    model = loragen.get_lora_model(
        TinyLM(), loragen.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], **config)
    )
    # B starts at zero (the adapter is a no-op), which would make every gradient of A zero: perturb it
    # so that both factors get gradients worth comparing.
    with torch.no_grad():
        for layer in find_lora_layers(model).values():
            layer.lora_B.normal_(std=0.1)
    return model


def _batch(seed: int = 0, batch: int = 8, length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, length), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def _lm_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


# --- gradient accumulation --------------------------------------------------------------------------


def test_gradient_accumulation_equals_the_big_batch() -> None:
    big = _lora_tiny_lm(modules_to_save=["head"])
    micro = _lora_tiny_lm(modules_to_save=["head"])
    ids, targets = _batch(batch=16)
    big_optimizer, micro_optimizer = make_optimizer(big, lr=1e-2), make_optimizer(micro, lr=1e-2)

    for _ in range(3):
        big_optimizer.zero_grad()
        _lm_loss(big, ids, targets).backward()
        big_optimizer.step()

        micro_optimizer.zero_grad()
        for chunk_ids, chunk_targets in zip(ids.chunk(4), targets.chunk(4)):
            (_lm_loss(micro, chunk_ids, chunk_targets) / 4).backward()
        for name, grad in _grads(micro).items():
            torch.testing.assert_close(grad, _grads(big)[name], rtol=1e-5, atol=1e-7, msg=name)
        micro_optimizer.step()

    for (name, a), b in zip(big.named_parameters(), micro.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


# --- gradient checkpointing -----------------------------------------------------------------------


def _reference_grads(seed: int = 0) -> dict[str, torch.Tensor | None]:
    model = _lora_tiny_lm(seed)
    _lm_loss(model, *_batch()).backward()
    return _grads(model)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_modules_gives_the_same_gradients(use_reentrant: bool) -> None:
    expected = _reference_grads()
    model = _lora_tiny_lm()
    assert checkpoint_modules(model, ["blocks.0", "blocks.1", "blocks.2"], use_reentrant=use_reentrant) == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
    ]
    if use_reentrant:
        enable_input_require_grads(model, model.embed)
    _lm_loss(model, *_batch()).backward()
    got = _grads(model)
    assert set(got) == set(expected) and all(g is not None for g in got.values())
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_reentrant_checkpointing_without_input_grads_loses_lora_gradients_and_the_helper_fixes_it() -> None:
    # The failure peft users hit: frozen embedding + reentrant checkpointing. With a trained head the LoRA
    # weights silently get no gradient; with everything else frozen backward() fails outright.
    model = _lora_tiny_lm(modules_to_save=["head"])
    checkpoint_modules(model, ["blocks.0", "blocks.1", "blocks.2"], use_reentrant=True)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        _lm_loss(model, *_batch()).backward()
    assert model.head.weight.grad is not None
    assert all(p.grad is None for name, p in model.named_parameters() if "lora_" in name)

    handle = enable_input_require_grads(model, model.embed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lm_loss(model, *_batch()).backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_" in n
    )
    handle.remove()
    assert not model.embed._forward_hooks

    lora_only = _lora_tiny_lm()
    checkpoint_modules(lora_only, ["blocks.0", "blocks.1", "blocks.2"], use_reentrant=True)
    with (
        pytest.warns(UserWarning, match="None of the inputs"),
        pytest.raises(RuntimeError, match="does not require grad"),
    ):
        _lm_loss(lora_only, *_batch()).backward()


def test_checkpoint_modules_is_a_no_op_without_grad() -> None:
    model = _lora_tiny_lm()
    ids, _ = _batch()
    expected = model(ids)
    checkpoint_modules(model, ["blocks.1"], use_reentrant=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected)


def test_checkpoint_modules_errors() -> None:
    model = _lora_tiny_lm()
    with pytest.raises(
        TrainingSetupError,
        match=r"no submodule 'blocks\.7'; did you mean one of \['blocks\.2', 'blocks\.1', 'blocks\.0'",
    ):
        checkpoint_modules(model, ["blocks.7"])
    with pytest.raises(TrainingSetupError, match="TinyLM has no submodule ''"):
        checkpoint_modules(model, [""])
    checkpoint_modules(model, ["blocks.0"])
    with pytest.raises(TrainingSetupError, match=r"'blocks\.0' is already checkpointed"):
        checkpoint_modules(model, ["blocks.0"])


def test_enable_input_require_grads_needs_a_module_for_plain_models() -> None:
    with pytest.raises(TrainingSetupError, match="TinyLM has no get_input_embeddings\\(\\); pass module="):
        enable_input_require_grads(_lora_tiny_lm())


# --- transformers: gradient_checkpointing_enable on a tiny Llama, hybrid training --------------------


def _lora_llama(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
            max_position_embeddings=64,
        )
    )
    config = loragen.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        modules_to_save=["lm_head"],
    )
    model = loragen.get_lora_model(model, config)
    with torch.no_grad():
        for layer in find_lora_layers(model).values():
            layer.lora_B.normal_(std=0.05)
    model.train()
    return model


def _llama_loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(seed))
    # No KV cache while training: a checkpointed layer recomputed in backward would append to it twice.
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_transformers_gradient_checkpointing_matches(use_reentrant: bool) -> None:
    reference = _lora_llama()
    _llama_loss(reference).backward()
    model = _lora_llama()
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", FutureWarning
        )  # transformers 5 renamed it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:
        enable_input_require_grads(
            model
        )  # transformers adds its own for input_ids models; two hooks are harmless
    _llama_loss(model).backward()
    expected = _grads(reference)
    for name, grad in _grads(model).items():
        assert grad is not None, name
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_reentrant_checkpointing_of_llama_layers_needs_input_grads() -> None:
    # Checkpointing the decoder layers by hand (as a plain-torch training loop would) shows the raw problem.
    expected = _lora_llama()
    _llama_loss(expected).backward()
    model = _lora_llama()
    checkpoint_modules(model, ["model.layers.0", "model.layers.1"], use_reentrant=True)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        _llama_loss(model).backward()
    assert all(p.grad is None for name, p in model.named_parameters() if "lora_" in name)
    model.zero_grad()
    enable_input_require_grads(model)
    _llama_loss(model).backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(expected)[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("eight_bit", [False, True])
def test_hybrid_training_updates_lora_and_the_saved_module_only(eight_bit: bool, tmp_path) -> None:
    model = _lora_llama()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if ".lora_" in n} | {"lm_head.weight"}
    assert len(trainable) == 2 * 4 * 2 + 1
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = make_optimizer(
        model, lr=1e-2, eight_bit=eight_bit, **({"min_8bit_size": 1024} if eight_bit else {})
    )
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = _llama_loss(model)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == (name in trainable), name
    if eight_bit:
        assert "exp_avg_codes" in optimizer.state[model.lm_head.weight]

    loragen.save_adapter(model, tmp_path / "adapter")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(model.config)
    base.load_state_dict({k: v for k, v in before.items() if ".lora_" not in k}, strict=True)
    loaded = loragen.load_adapter(base, tmp_path / "adapter")
    model.eval()
    loaded.eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5
    )


# --- mixed precision ---------------------------------------------------------------------------------


def test_bf16_autocast_on_cpu_matches_fp32_loss_and_gradients() -> None:
    fp32 = _lora_tiny_lm(modules_to_save=["head"])
    bf16 = _lora_tiny_lm(modules_to_save=["head"])
    ids, targets = _batch(batch=16)
    loss32 = _lm_loss(fp32, ids, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16 = _lm_loss(bf16, ids, targets)
    assert loss16.dtype == torch.float32  # cross_entropy runs in fp32 under autocast
    assert loss16.item() == pytest.approx(loss32.item(), rel=1e-2)
    loss32.backward()
    loss16.backward()
    for name, grad in _grads(bf16).items():
        reference = _grads(fp32)[name]
        assert grad.dtype == torch.float32, name  # master weights and their gradients stay fp32
        cosine = F.cosine_similarity(grad.flatten(), reference.flatten(), dim=0).item()
        assert cosine > 0.99, (name, cosine)

    # A short run: the two loss curves stay together.
    curves = []
    for model, autocast in ((fp32, False), (bf16, True)):
        optimizer = make_optimizer(model, lr=5e-3)
        losses = []
        for step in range(15):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = _lm_loss(model, *_batch(seed=step, batch=16))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[0][-1] < curves[0][0]
    assert curves[1] == pytest.approx(curves[0], rel=2e-2)


# --- helpers outside torch.distributed ---------------------------------------------------------------


def test_single_process_helpers(tmp_path) -> None:
    model = _lora_tiny_lm()
    assert is_main_process()
    assert unwrap_model(model) is model
    compiled_like = nn.Module()
    compiled_like._orig_mod = model
    assert unwrap_model(compiled_like) is model
    with pytest.raises(TrainingSetupError, match=r"torch\.distributed is not initialized"):
        wrap_ddp(model)
    assert save_adapter_main_process(model, tmp_path / "adapter") == tmp_path / "adapter"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
