"""Sweep transformers architectures: convert each with ``target_modules="all-linear"`` into peft and loragen.

For every model type transformers registers a base model for (``MODEL_MAPPING_NAMES``; the causal LM class
where there is no base model), the script builds a tiny model from the config class (hidden 32, 1 layer,
2 heads, vocabulary 64 where the config has those fields), converts two copies of the same seed-initialised
base into peft (``peft.get_peft_model``) and loragen (``loragen.get_lora_model``), copies peft's LoRA A/B
values into loragen's (B random, so the LoRA terms show), runs forward and backward on a tiny input, and
compares the first output and every LoRA gradient (fp32, 1e-5). Where the base model accepts a zero-size
batch, loragen must too; ``model.train()`` with ``lora_dropout=0.1`` must run.

Then the adapter files both ways: the folder ``loragen.save_adapter`` writes must load in
``peft.PeftModel.from_pretrained`` with no missing or unexpected key and give loragen's output, and
peft's own folder must load in ``loragen.load_adapter`` and give peft's.

Then ``loragen.merge_and_unload`` must give the same output with plain layers only (or, where peft's own
merge moves its output too, peft's merged output).

Results: ``ok``, ``loragen crash``, ``mismatch``, ``format mismatch``, ``merge mismatch``, ``peft also fails``,
``skipped`` (the base model cannot be built or run offline from a tiny config; the reason is given). Each
model runs in a worker process under a per-model time limit; a worker that hangs is killed and the model
recorded as ``timeout``.

    OMP_NUM_THREADS=1 python scripts/sweep_architectures.py --out sweep_results.md [--only llama,bert] [--dora]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

# the config fields that set a model's size, and the tiny value each takes (where a config has the field)
_WIDTH = ["hidden_size", "d_model", "n_embd", "embed_dim", "dim", "n_embed", "d_embed", "hidden_dim"]
_FFN = ["intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner"]
_LAYERS = ["num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers"]
_HEADS = ["num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads"]
_LENGTHS = ["vocab_size", "max_position_embeddings", "n_positions", "max_seq_len"]
SMALL: dict[str, int] = {
    **dict.fromkeys([*_WIDTH, "model_dim", "text_hidden_size", "projection_dim", "image_size"], 32),
    **dict.fromkeys([*_FFN, "ffn_hidden_size", *_LENGTHS], 64),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size"], 16),
    **dict.fromkeys(["head_dim", "d_kv", "kv_channels"], 16),
    **dict.fromkeys([*_LAYERS, "num_decoder_layers", "num_encoder_layers"], 1),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads"], 1),
    **dict.fromkeys([*_HEADS, "num_heads", "num_experts_per_tok"], 2),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts"], 4),
    "patch_size": 8,
    "num_channels": 3,
}
VOCAB = 64
SEQ = 6


def _shrink(config: Any, depth: int = 0) -> None:
    """Set the size fields of ``config`` (and of its sub-configs) that it has to tiny values."""
    from transformers import PretrainedConfig

    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig) and depth < 3:
            _shrink(value, depth + 1)
        elif key in SMALL and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            setattr(config, key, min(value, SMALL[key]) if key not in ("vocab_size",) else SMALL[key])
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(getattr(config, key, None), list):
            n = getattr(config, "num_hidden_layers", 1)
            setattr(config, key, getattr(config, key)[:n])
    # token ids the tiny vocabulary can hold
    for key, value in list(vars(config).items()):
        if key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            setattr(config, key, VOCAB - 1 - (hash(key) % 8))


def _model_class(model_type: str) -> Any:
    import transformers
    from transformers.models.auto import modeling_auto as auto

    for mapping in (auto.MODEL_MAPPING_NAMES, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        name = mapping.get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name:
            return getattr(transformers, name)
    raise LookupError("no base or causal-LM class")


def _inputs(model: Any, config: Any) -> dict[str, Any]:
    import torch

    params = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(2)
    inputs: dict[str, Any] = {}
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_ids" or ("input_ids" in params and main not in params):
        inputs["input_ids"] = torch.randint(3, VOCAB - 10, (2, SEQ), generator=generator)
    elif main == "pixel_values":
        vision = getattr(config, "vision_config", config)
        size = getattr(vision, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(vision, "num_channels", 3)
        inputs["pixel_values"] = torch.randn(1, channels, size, size, generator=generator)
    elif main == "input_values":
        inputs["input_values"] = torch.randn(1, 1600, generator=generator)
    elif main == "input_features":
        bins = getattr(config, "num_mel_bins", getattr(config, "feature_size", 80))
        inputs["input_features"] = torch.randn(
            1, bins, 3000 if "whisper" in config.model_type else 64, generator=generator
        )
    elif main == "inputs_embeds":
        inputs["inputs_embeds"] = torch.randn(2, SEQ, getattr(config, "hidden_size", 32), generator=generator)
    else:
        raise LookupError(f"main input {main!r} not handled")
    if ("decoder_input_ids" in params and "input_ids" in inputs) or (
        "decoder_input_ids" in params and main in ("input_features",)
    ):
        inputs["decoder_input_ids"] = torch.randint(
            3, VOCAB - 10, (inputs[main].shape[0], 4), generator=generator
        )
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def _first_float(output: Any) -> Any:
    import torch

    values = output.to_tuple() if hasattr(output, "to_tuple") else output
    values = values if isinstance(values, (tuple, list)) else (values,)
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
        if isinstance(value, (tuple, list)):
            for inner in value:
                if isinstance(inner, torch.Tensor) and inner.is_floating_point():
                    return inner
    raise LookupError("no floating output")


# the LoRA settings both libraries convert with (r, alpha; --dora adds use_dora=True to both)
LORA: dict[str, Any] = {"r": 4, "lora_alpha": 8}


def _build(model_type: str, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    import torch
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    _shrink(config)
    config._attn_implementation = "eager"
    cls = _model_class(model_type)
    torch.manual_seed(seed)
    model = cls(config).eval()
    return model, _inputs(model, config)


def _run(model: Any, inputs: dict[str, Any]) -> Any:
    return _first_float(model(**inputs))


def _lora_key(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".default.weight", "")


def _not_timeout(error: BaseException) -> None:
    """Re-raise the per-model alarm's TimeoutError, so it is recorded as a timeout, not a crash."""
    if isinstance(error, TimeoutError):
        raise error


def check(model_type: str) -> dict[str, Any]:
    """Check one model type; return ``{"status": ..., "detail": ...}``."""
    import peft
    import torch

    import loragen

    # the base model alone: built and run, else skipped
    try:
        base, inputs = _build(model_type)
        first = _run(base, inputs)
        if not torch.equal(
            first, _run(base, inputs)
        ):  # random masking / noise in forward: nothing to compare
            return {"status": "skipped", "detail": "base: forward is random (two calls differ)"}
    except Exception as error:
        _not_timeout(error)
        return {"status": "skipped", "detail": f"base: {type(error).__name__}: {str(error)[:160]}"}

    config = loragen.LoraConfig(**LORA, target_modules="all-linear")
    try:
        theirs, _ = _build(model_type)
        theirs = peft.get_peft_model(theirs, peft.LoraConfig(**LORA, target_modules="all-linear"))
        peft_out = _run(theirs, inputs)
    except Exception as error:
        _not_timeout(error)
        peft_error = f"{type(error).__name__}: {str(error)[:160]}"
        try:
            ours, _ = _build(model_type)
            loragen.get_lora_model(ours, config)
            _run(ours, inputs)
            return {"status": "peft also fails", "detail": f"peft: {peft_error}; loragen runs"}
        except Exception as ours_error:
            _not_timeout(ours_error)
            return {
                "status": "peft also fails",
                "detail": f"peft: {peft_error}; loragen: {type(ours_error).__name__}: {str(ours_error)[:120]}",
            }

    stage = "convert"
    notes: list[str] = []
    hosts: set[str] = set()  # modules whose parameters loragen adapts (MoE experts, routers)
    try:
        ours, _ = _build(model_type)
        loragen.get_lora_model(ours, config)
        ours_params = dict(ours.named_parameters())
        peft_keys = {
            _lora_key(n)
            for n, _ in theirs.named_parameters()
            if ".lora_A.default." in n or ".lora_B.default." in n
        }
        ours_keys = {n for n in ours_params if n.endswith((".lora_A", ".lora_B"))}
        if peft_keys != ours_keys:
            # note the difference, then compare on loragen's layers (peft given them as an explicit list)
            notes.append(
                f"targets differ: peft only {sorted(peft_keys - ours_keys)[:3]}, loragen only {sorted(ours_keys - peft_keys)[:3]}"
            )
            # modules whose parameters loragen adapts (MoE experts, routers: ``lora_targets``) stay out of
            # peft's explicit list, which takes modules only; their B start at zero, so they add nothing to
            # the forward, and their parity with peft is tested in tests/test_all_linear_moe.py
            hosts = {key.split(".lora_targets.")[0] for key in ours_keys if ".lora_targets." in key}
            targets = sorted(set(loragen.convert.find_lora_layers(ours)) - hosts)
            if hosts:
                notes.append(f"parameter targets not compared: {sorted(hosts)[:3]}")
            stage = "peft convert (loragen's layers)"
            theirs, _ = _build(model_type)
            theirs = peft.get_peft_model(theirs, peft.LoraConfig(**LORA, target_modules=targets))
            stage = "convert"
        generator = torch.Generator().manual_seed(1)
        for name, p in theirs.named_parameters():
            if ".lora_A.default." in name or ".lora_B.default." in name:
                with torch.no_grad():
                    if _lora_key(name) not in ours_params:  # peft adapts MoE experts' parameters too: off
                        p.zero_()
                        continue
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
                    ours_params[_lora_key(name)].copy_(p)
        stage = "peft forward"
        peft_out = _run(theirs, inputs)
        stage = "forward"
        ours_out = _run(ours, inputs)
        weights = torch.linspace(-1, 1, peft_out.numel()).view(peft_out.shape)
        if peft_out.requires_grad:  # else the first output does not depend on any adapted layer
            stage = "peft backward"
            (peft_out * weights).sum().backward()
            stage = "backward"
            (ours_out * weights).sum().backward()
        else:
            notes.append("first output independent of the LoRA layers (no backward)")
    except Exception as error:
        _not_timeout(error)
        status = "peft also fails" if stage.startswith("peft") else "loragen crash"
        return {
            "status": status,
            "detail": f"{stage}: {type(error).__name__}: {str(error)[:200]}",
            "traceback": traceback.format_exc()[-1500:],
        }
    try:
        # fp32, 1e-5 relative to the largest entry: models whose activations reach 1e3 round at 1e-4
        torch.testing.assert_close(
            ours_out, peft_out, rtol=1e-5, atol=1e-5 * max(1.0, peft_out.abs().max().item())
        )
        for name, p in theirs.named_parameters():
            if (
                p.grad is not None
                and (".lora_A." in name or ".lora_B." in name)
                and _lora_key(name) in ours_params
            ):
                grad = ours_params[_lora_key(name)].grad
                if grad is None:
                    raise AssertionError(f"{_lora_key(name)}: no loragen grad")
                # 1e-4 relative to the largest entry: gradients sum over every row, and fp32 rounding of
                # 1e3-sized activations leaves ~1e-5 relative (fp64 runs of cvt and embedding_gemma2 agree)
                scale = max(1.0, p.grad.abs().max().item())
                torch.testing.assert_close(
                    grad,
                    p.grad,
                    rtol=1e-4,
                    atol=1e-4 * scale,
                    msg=lambda m, k=name: f"grad {_lora_key(k)}: {m[:120]}",
                )
    except AssertionError as error:
        detail = str(error).replace("\n", " ")[:240]
        try:
            noise = _fp64_noise(model_type, theirs, ours_params, inputs, ours_out, peft_out)
        except Exception as arbiter_error:
            _not_timeout(arbiter_error)
            noise = f"no fp64 arbiter ({type(arbiter_error).__name__})"
        if noise.startswith("fp32 noise"):
            return {"status": "ok (fp32 noise)", "detail": f"{noise}; {detail[:120]}"}
        return {"status": "mismatch", "detail": "; ".join([*notes, noise, detail])}

    # the adapter files, both ways: loragen's folder in peft, peft's folder in loragen
    try:
        problem = _adapter_round_trip(model_type, ours, theirs, inputs, ours_out, peft_out)
    except Exception as error:
        _not_timeout(error)
        problem = f"{type(error).__name__}: {str(error)[:200]}"
    own = None if problem is None else _peft_own_round_trip(model_type, theirs, inputs, peft_out)
    if own is not None:
        notes.append(f"adapter files not judged: {own} ({problem[:80]})")
    elif problem is not None:
        return {
            "status": "format mismatch",
            "detail": "; ".join([*notes, problem]),
            "traceback": traceback.format_exc()[-1500:],
        }

    # merged into the base weights: the same output, as plain layers again (or, where peft's own merge moves
    # its output too -- a forward that takes discrete decisions on its activations --, peft's merged output)
    try:
        merged = loragen.merge_and_unload(copy.deepcopy(ours))
        if loragen.convert.find_lora_layers(merged):
            raise AssertionError("LoRA layers left after merge_and_unload")
        with torch.no_grad():
            got = _run(merged, inputs)
        if not _close(got, ours_out):
            theirs_merged = _peft_merged_output(theirs, inputs)
            if _close(theirs_merged, peft_out) or not _close(got, theirs_merged):
                raise AssertionError(
                    f"merged output moved by {(got - ours_out).abs().max().item():.3g}; peft's merged output "
                    f"by {(theirs_merged - peft_out).abs().max().item():.3g}, and loragen's differs from it by "
                    f"{(got - theirs_merged).abs().max().item():.3g}"
                )
            notes.append("merged output equals peft's merged one (both move the unmerged output)")
    except Exception as error:
        _not_timeout(error)
        return {
            "status": "merge mismatch",
            "detail": "; ".join([*notes, f"{type(error).__name__}: {str(error)[:200]}"]),
            "traceback": traceback.format_exc()[-1500:],
        }

    # zero-size batch, where the base model takes one
    empty = {k: v[:0] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    try:
        _run(base, empty)
    except Exception:
        notes.append("empty batch: base refuses")
    else:
        try:
            out = _run(ours, empty)
            if out.requires_grad:
                out.sum().backward()
        except Exception as error:
            _not_timeout(error)
            return {
                "status": "loragen crash",
                "detail": f"empty batch: {type(error).__name__}: {str(error)[:200]}",
                "traceback": traceback.format_exc()[-1500:],
            }
    # training mode with dropout
    try:
        trained, _ = _build(model_type)
        # dropout on parameter targets is refused, as by peft: there the check runs on the module targets
        dropout_config = config.replace(lora_dropout=0.1)
        if hosts:
            layers = sorted(set(loragen.convert.find_lora_layers(ours)) - hosts)
            dropout_config = dropout_config.replace(target_modules=layers)
        loragen.get_lora_model(trained, dropout_config).train()
        out = _run(trained, inputs)
        if out.requires_grad:
            out.float().sum().backward()
    except Exception as error:
        _not_timeout(error)
        try:
            plain, _ = _build(model_type)
            _run(plain.train(), inputs).float().sum().backward()
        except Exception:
            notes.append("train mode: base fails too")
        else:
            return {
                "status": "loragen crash",
                "detail": f"train+dropout: {type(error).__name__}: {str(error)[:200]}",
                "traceback": traceback.format_exc()[-1500:],
            }
    targets_differ = any(note.startswith("targets differ") for note in notes)
    return {"status": "targets differ" if targets_differ else "ok", "detail": "; ".join(notes)}


def _adapter_round_trip(
    model_type: str, ours: Any, theirs: Any, inputs: dict[str, Any], ours_out: Any, peft_out: Any
) -> str | None:
    """What goes wrong when ``peft.PeftModel.from_pretrained`` reads the folder ``loragen.save_adapter``
    wrote for ``ours``, or ``loragen.load_adapter`` the folder peft's ``save_pretrained`` wrote for
    ``theirs`` (an error, a missing or unexpected key, another output), or None when nothing does."""
    import tempfile

    import peft
    import torch

    import loragen

    def close(got: Any, want: Any) -> None:
        want = want.detach()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))

    with tempfile.TemporaryDirectory() as folder:
        loragen.save_adapter(ours, folder)
        fresh, _ = _build(model_type)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = peft.PeftModel.from_pretrained(fresh, folder)
        keys = [str(w.message)[:160] for w in caught if "missing adapter keys" in str(w.message)]
        if keys:
            return f"peft reads loragen's folder: {keys[0]}"
        with torch.no_grad():
            try:
                close(_run(loaded, inputs), ours_out)
            except AssertionError as error:
                return f"peft reads loragen's folder: output differs: {str(error)[:160]}"
    with tempfile.TemporaryDirectory() as folder:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs.save_pretrained(folder)
        fresh, _ = _build(model_type)
        again = loragen.load_adapter(fresh, folder)
        with torch.no_grad():
            try:
                close(_run(again, inputs), peft_out)
            except AssertionError as error:
                return f"loragen reads peft's folder: output differs: {str(error)[:160]}"
    return None


def _close(got: Any, want: Any) -> bool:
    """Within the merge check's tolerance: 1e-4 relative, and 1e-4 of the largest entry."""
    import torch

    want = want.detach()
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item())))


def _peft_merged_output(theirs: Any, inputs: dict[str, Any]) -> Any:
    """peft's output after its own ``merge_and_unload`` (of a copy)."""
    import torch

    with torch.no_grad():
        return _run(copy.deepcopy(theirs).merge_and_unload(), inputs)


def _peft_own_round_trip(model_type: str, theirs: Any, inputs: dict[str, Any], peft_out: Any) -> str | None:
    """What goes wrong when peft reads the folder it wrote itself for ``theirs`` (a key reported missing,
    another output), or None. Where that fails too, loragen's folder cannot be judged by peft."""
    import tempfile

    import peft
    import torch

    with tempfile.TemporaryDirectory() as folder:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs.save_pretrained(folder)
        fresh, _ = _build(model_type)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = peft.PeftModel.from_pretrained(fresh, folder)
        if any("missing adapter keys" in str(w.message) for w in caught):
            return "peft reports keys of its own folder missing"
        with torch.no_grad():
            if not torch.allclose(_run(again, inputs), peft_out.detach(), rtol=1e-5, atol=1e-5):
                return "peft's reloaded output differs from its own"
    return None


def _fp64_noise(
    model_type: str,
    theirs: Any,
    ours_params: dict[str, Any],
    inputs: dict[str, Any],
    ours_out: Any,
    peft_out: Any,
) -> str:
    """Whether loragen's difference from peft is fp32 rounding: peft rerun in float64 is the reference;
    loragen's output and LoRA gradients must be no further from it than 2x peft's own fp32 run (+ 1e-6)."""
    import peft
    import torch

    targets = sorted({_lora_key(n).rsplit(".", 1)[0] for n in ours_params if n.endswith(".lora_A")})
    wide, _ = _build(model_type)
    wide = peft.get_peft_model(wide, peft.LoraConfig(**LORA, target_modules=targets))
    theirs_params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, p in wide.named_parameters():
            if name in theirs_params and (".lora_A." in name or ".lora_B." in name):
                p.copy_(theirs_params[name])
    wide = wide.double()
    doubled = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }
    ref = _run(wide, doubled)
    ref_scale = max(1.0, ref.abs().max().item())
    pairs = [(ours_out.double(), peft_out.double(), ref, ref_scale, "output")]
    if ref.requires_grad:
        (ref * torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).view(ref.shape)).sum().backward()
        for name, p in wide.named_parameters():
            key = _lora_key(name)
            if p.grad is not None and key in ours_params and ours_params[key].grad is not None:
                pairs.append(
                    (
                        ours_params[key].grad.double(),
                        theirs_params[name].grad.double(),
                        p.grad,
                        max(1.0, p.grad.abs().max().item()),
                        key,
                    )
                )
    for ours_value, peft_value, exact, scale, what in pairs:
        ours_err = (ours_value - exact).abs().max().item()
        peft_err = (peft_value - exact).abs().max().item()
        if ours_err > 2 * peft_err + 1e-6 * scale:
            found = (
                f"fp64: {what} loragen err {ours_err:.3g} vs peft fp32 err {peft_err:.3g} (max {scale:.3g})"
            )
            return _both_in_fp64(model_type, wide, doubled, ref, found)
    return f"fp32 noise: within 2x of peft fp32's own error from fp64 on output and {len(pairs) - 1} grads"


def _both_in_fp64(model_type: str, wide: Any, doubled: dict[str, Any], ref: Any, found: str) -> str:
    """loragen in float64 against peft in float64 (``wide``, already run backward): agreement to 1e-9
    means the fp32 difference is rounding amplified by the model, not a different computation."""
    import torch

    import loragen

    targets = sorted({_lora_key(n).rsplit(".", 1)[0] for n, _ in wide.named_parameters() if ".lora_A." in n})
    ours, _ = _build(model_type)
    loragen.get_lora_model(ours, loragen.LoraConfig(**LORA, target_modules=targets))
    ours_params = dict(ours.named_parameters())
    wide_params = {_lora_key(n): p for n, p in wide.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    with torch.no_grad():
        for key, p in ours_params.items():
            if key in wide_params:
                p.copy_(wide_params[key])
    ours = ours.double()
    out = _run(ours, doubled)
    worst = (out - ref).abs().max().item() / max(1.0, ref.abs().max().item())
    if ref.requires_grad:
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        for key, p in wide_params.items():
            if p.grad is not None and ours_params[key].grad is not None:
                scale = max(1.0, p.grad.abs().max().item())
                worst = max(worst, (ours_params[key].grad - p.grad).abs().max().item() / scale)
    if worst < 1e-9:
        return f"fp32 noise: {found}, but loragen and peft agree in float64 (rel {worst:.1e})"
    return f"{found}; float64 rel diff {worst:.1e}"


def _worker(model_types: list[str], limit: int) -> None:
    """Check each model type in turn, one JSON line per result on stdout."""
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"over {limit} s")

    signal.signal(signal.SIGALRM, on_alarm)
    for model_type in model_types:
        start = time.monotonic()
        signal.alarm(limit)
        try:
            result = check(model_type)
        except TimeoutError as error:
            result = {"status": "timeout", "detail": str(error)}
        except Exception as error:
            result = {"status": "skipped", "detail": f"harness: {type(error).__name__}: {str(error)[:160]}"}
        finally:
            signal.alarm(0)
        result.update(model_type=model_type, seconds=round(time.monotonic() - start, 1))
        print(json.dumps(result), flush=True)


class _Watchdog:
    """Kill the worker when it reports nothing for ``seconds`` (a hang the alarm cannot interrupt)."""

    def __init__(self, process: subprocess.Popen[str], seconds: float) -> None:
        import threading

        self.process, self.seconds, self.last, self.done = process, seconds, time.monotonic(), False
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        """A result arrived."""
        self.last = time.monotonic()

    def stop(self) -> None:
        """The worker ended."""
        self.done = True

    def _watch(self) -> None:
        while not self.done and self.process.poll() is None:
            if time.monotonic() - self.last > self.seconds:
                self.process.kill()
                return
            time.sleep(1)


def _all_types() -> list[str]:
    from transformers.models.auto import modeling_auto as auto

    return sorted(set(auto.MODEL_MAPPING_NAMES) | set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def _table(results: list[dict[str, Any]], command: str) -> str:
    counts: dict[str, int] = {}
    for result in results:
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    lines = [
        "# loragen vs peft on transformers architectures",
        "",
        f"Command: `{command}`",
        "",
        "Counts: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + f" (total {len(results)})",
        "",
        "| model type | status | detail |",
        "|---|---|---|",
    ]
    order = {
        "ok (fp32 noise)": 4.5,
        "loragen crash": 0,
        "mismatch": 1,
        "format mismatch": 1.5,
        "merge mismatch": 1.6,
        "timeout": 2,
        "targets differ": 3,
        "peft also fails": 4,
        "ok": 5,
        "skipped": 6,
    }
    for result in sorted(results, key=lambda r: (order.get(r["status"], 9), r["model_type"])):
        detail = result.get("detail", "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {result['model_type']} | {result['status']} | {detail} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the sweep in worker processes; write the results table and a JSON-lines log."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="sweep_results.md")
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--limit", type=int, default=60, help="seconds per model")
    parser.add_argument("--dora", action="store_true", help="DoRA (use_dora=True) in both libraries")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("types", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dora:
        LORA["use_dora"] = True
    if args.worker:
        _worker(args.types, args.limit)
        return
    todo = [t for t in args.only.split(",") if t] or _all_types()
    log = Path(args.out).with_suffix(".jsonl")
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(todo):
        pending = [t for t in todo if t not in done]
        process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--limit",
                str(args.limit),
                *(["--dora"] if args.dora else []),
                *pending,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert process.stdout is not None
        watchdog = _Watchdog(process, 3 * args.limit)
        for line in process.stdout:
            watchdog.reset()
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[result["model_type"]] = result
            with log.open("a") as f:
                f.write(line)
            print(
                f"{result['model_type']:32} {result['status']:16} {result.get('detail', '')[:100]}",
                flush=True,
            )
        process.wait()
        watchdog.stop()
        stuck = next((t for t in todo if t not in done), None)
        if stuck is not None:  # the worker died on this one (segfault, hang past the alarm)
            done[stuck] = {
                "model_type": stuck,
                "status": "timeout",
                "detail": f"worker died (rc {process.returncode})",
            }
    command = "OMP_NUM_THREADS=1 python scripts/sweep_architectures.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(_table(list(done.values()), command))


if __name__ == "__main__":
    main()
