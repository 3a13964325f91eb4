"""A tiny Llama with loragen's LoRA on all seven projections, trained eagerly and with its whole step
captured in one CUDA graph, for tests/cuda/test_cuda_graphed_model.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import loragen

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 3  # steps compared, after the warm-up steps both sides take
WARMUP = 2  # eager steps before the capture (on a side stream for the graphed model)
# SGD: each parameter's change is lr times its gradient, so a kernel choice that rounds a bf16 product
# differently moves a parameter by about lr * 1e-3 of its gradient, far under the changes compared (a
# replay reading factors one step old, or not updating them, is off by a whole step's change)
LEARNING_RATE = 0.1
TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


def build(device: str | torch.device, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """The model (bf16 base, float32 adapters, B drawn so that LoRA's term is not zero), its SGD optimizer
    and a batch of token ids; the same for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    model: nn.Module = LlamaForCausalLM(config).to(device, torch.bfloat16)
    model = loragen.get_lora_model(model, loragen.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
        if "lora_B" in name:
            nn.init.normal_(param, std=0.05)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LEARNING_RATE)
    ids = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(seed)).to(
        device
    )
    return model, optimizer, ids


def step_function(
    model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """One training step returning its loss; gradients zeroed in place (kept allocated, as a captured
    step needs them), so the eager and the captured step add each gradient onto zeros alike."""

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=False)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def eager_losses(device: str | torch.device, steps: int) -> tuple[list[float], nn.Module]:
    """The losses of ``steps`` eager steps, and the model after them."""
    model, optimizer, ids = build(device)
    step = step_function(model, optimizer, ids)
    return [step().item() for _ in range(steps)], model


def graphed_losses(steps: int) -> tuple[list[float], nn.Module]:
    """:data:`WARMUP` eager steps on a side stream, the step captured, then ``steps`` - :data:`WARMUP`
    replays: the losses of all of them, and the model after them."""
    model, optimizer, ids = build("cuda")
    step = step_function(model, optimizer, ids)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        losses = [step().item() for _ in range(WARMUP)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    for _ in range(steps - WARMUP):
        graph.replay()
        losses.append(static_loss.item())
    return losses, model


def compare() -> list[str]:
    """What differs between the eager and the graphed training (empty: they agree)."""
    total = WARMUP + STEPS
    eager, eager_model = eager_losses("cuda", total)
    graphed, graphed_model = graphed_losses(total)
    problems = []
    try:
        torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), **TOLERANCE)
    except AssertionError as error:
        problems.append(f"losses: graphed {graphed}, eager {eager}: {error}")
    initial, _, _ = build("cuda")
    before = dict(initial.named_parameters())
    moved = 0.0
    for (name, got), (_, want) in zip(graphed_model.named_parameters(), eager_model.named_parameters()):
        if not got.requires_grad:
            continue
        if torch.equal(want, before[name]):
            problems.append(f"{name}: the eager steps did not change it")
        moved = max(moved, (want - before[name]).abs().max().item())
        try:
            torch.testing.assert_close(got, want, **TOLERANCE)
        except AssertionError as error:
            problems.append(f"{name}: {error}")
    if moved < 10 * TOLERANCE["atol"]:
        problems.append(f"the steps moved no parameter by more than {moved:.2e}: too little to compare")
    return problems
