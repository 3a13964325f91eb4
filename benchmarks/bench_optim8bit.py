"""8-bit AdamW against torch's AdamW: optimizer-state bytes and the demo's loss curve.

Run from the repository root:

    OMP_NUM_THREADS=2 python benchmarks/bench_optim8bit.py

1. The demo's LoRA fine-tune (``loragen demo``: LoRA on conv1/conv2/fc, the head trained fully), run
   with identical data order and seeds under torch.optim.AdamW and loragen's AdamW8bit (default
   ``min_8bit_size=4096``, and ``min_8bit_size=0`` so that every tensor is quantized). Reported per run:
   optimizer-state bytes; the mean loss over all steps (the area under the curve) and over the last 50
   steps, each relative to AdamW; the mean pointwise gap between the smoothed (20-step) curves; the
   rotated-digit test accuracy. Training is chaotic, so any change moves the pointwise curve: the
   "noise floor" row is AdamW with its learning rate changed by 0.1%.
2. The hybrid case the 8-bit states are for: a Llama (built from a config, random weights) with LoRA on
   the attention projections and ``embed_tokens`` + ``lm_head`` trained fully (``modules_to_save``).
   Reported: state bytes after one step, and the mean optimizer-step time (interleaved repeats, median).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import loragen
from loragen._examples.demo import (
    DemoOptions,
    bundled_model_file,
    demo_config,
    evaluate,
    load_digits_domains,
    load_model_class,
    pretrain_base,
)
from loragen.training.optimizers import make_optimizer, optimizer_state_bytes


def smooth(values: list[float], window: int = 20) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def demo_curves(steps: int, seed: int) -> None:
    options = DemoOptions(steps=steps, seed=seed, progress=False)
    path = bundled_model_file()
    model_cls = load_model_class(path.read_text(encoding="utf-8"), "bench_digits", str(path))
    data = load_digits_domains(seed)
    base, _ = pretrain_base(model_cls, data, options, torch.device("cpu"))
    base_state = {k: v.clone() for k, v in base.state_dict().items()}

    runs: dict[str, tuple[list[float], int, float]] = {}
    for name, lr_scale, kwargs in (
        ("AdamW (fp32 states)", 1.0, None),
        ("AdamW, lr x 1.001 (noise floor)", 1.001, None),
        ("AdamW8bit (default min_8bit_size=4096)", 1.0, {}),
        ("AdamW8bit, min_8bit_size=0 (all quantized)", 1.0, {"min_8bit_size": 0}),
    ):
        model = model_cls()
        model.load_state_dict(base_state)
        torch.manual_seed(seed + 1)
        model = loragen.get_lora_model(model, demo_config(options))
        if kwargs is None:
            optimizer = make_optimizer(model, lr=options.lr * lr_scale)
        else:
            optimizer = make_optimizer(model, lr=options.lr, eight_bit=True, **kwargs)
        generator = torch.Generator().manual_seed(seed + 1)
        losses = []
        model.train()
        for _ in range(steps):
            index = torch.randint(0, len(data.train_y), (options.batch_size,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(data.shifted_train_x[index]), data.train_y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        accuracy = evaluate(model, data.shifted_test_x, data.test_y).accuracy
        runs[name] = (losses, optimizer_state_bytes(optimizer), accuracy)

    reference, ref_bytes, _ = runs["AdamW (fp32 states)"]
    ref_smooth = smooth(reference)
    print(f"\n### demo fine-tune: {steps} steps, seed {seed}\n")
    print(
        "| optimizer | state bytes | vs AdamW | mean loss (area) | area gap | final-50 loss | final gap "
        "| pointwise gap | rotated acc |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (losses, nbytes, accuracy) in runs.items():
        area, ref_area = statistics.fmean(losses), statistics.fmean(reference)
        final, ref_final = statistics.fmean(losses[-50:]), statistics.fmean(reference[-50:])
        pointwise = statistics.fmean(abs(a - b) / b for a, b in zip(smooth(losses), ref_smooth))
        print(
            f"| {name} | {nbytes:,} | {nbytes / ref_bytes - 1:+.1%} | {area:.4f} "
            f"| {area / ref_area - 1:+.2%} "
            f"| {final:.4f} | {final / ref_final - 1:+.2%} | {pointwise:.2%} | {accuracy:.1%} |"
        )


def hybrid_llama(repeats: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
        max_position_embeddings=128,
    )
    lora_config = loragen.LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        modules_to_save=["embed_tokens", "lm_head"],
    )
    ids = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    models, optimizers = {}, {}
    for name, eight_bit in (("AdamW (fp32 states)", False), ("AdamW8bit", True)):
        torch.manual_seed(0)
        model = loragen.get_lora_model(LlamaForCausalLM(config), lora_config)
        models[name] = model
        optimizers[name] = make_optimizer(model, lr=1e-3, eight_bit=eight_bit)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizers[name].step()
    trainable = sum(p.numel() for p in models["AdamW8bit"].parameters() if p.requires_grad)
    step_times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(repeats):  # interleaved, so that load from other processes hits both alike
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            step_times[name].append(time.perf_counter() - start)
    ref = optimizer_state_bytes(optimizers["AdamW (fp32 states)"])
    print(
        "\n### hybrid Llama (LoRA r=16 on attention; embed_tokens + lm_head trained): "
        f"{trainable:,} trainable\n"
    )
    print("| optimizer | state bytes | vs AdamW | bytes / trainable param | optimizer.step() median |")
    print("|---|---:|---:|---:|---:|")
    for name, optimizer in optimizers.items():
        nbytes = optimizer_state_bytes(optimizer)
        print(
            f"| {name} | {nbytes:,} | {nbytes / ref - 1:+.1%} | {nbytes / trainable:.3f} | "
            f"{statistics.median(step_times[name]) * 1e3:.1f} ms |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for seed in args.seeds:
        demo_curves(args.steps, seed)
    hybrid_llama(args.repeats)


if __name__ == "__main__":
    main()
