"""``loragen demo``: the main job end to end on data that ships with scikit-learn.

Each stage is a function, run in this order by :func:`run_demo`:

1. :func:`rewrite_model_file` — rewrite the bundled model file (``examples/digits_model.py``) with
   ``loragen rewrite`` and return the diff.
2. :func:`load_digits_domains` — scikit-learn's 8x8 handwritten digits: the *source* domain is the
   upright digits, the *shifted* domain the same digits rotated by 90 degrees.
3. :func:`pretrain_base` — train the plain model on upright digits (a genuinely trained base).
4. :func:`finetune_lora` — convert it with ``get_lora_model`` (LoRA on the convolutions and the hidden
   linear layer, the classifier head trained fully as ``modules_to_save``) and fine-tune on the rotated
   digits, with a progress bar.
5. :func:`check_adapter_roundtrip` — save the adapter in peft's format, load it into a fresh base, check
   it reproduces the trained model, merge, and check merged == unmerged.
6. :func:`check_rewritten_model` — the rewritten file's model, given the base checkpoint and the adapter,
   computes the same outputs: the rewrite and the runtime conversion agree.
7. :func:`plot_loss_curve` and :func:`summary_table` — ``loss_curve.png`` and ``summary.md``.

Everything is seeded: the same ``seed`` gives the same numbers (on the same machine and thread count).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import time
import types
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.nn import functional as F

from loragen.atomic import atomic_file, atomic_write_text
from loragen.config import LoraConfig
from loragen.convert import count_parameters, get_lora_model, merge_adapter
from loragen.training.optim import make_optimizer, optimizer_state_bytes

__all__ = [
    "AdapterCheck",
    "DemoError",
    "DemoOptions",
    "DemoResult",
    "DigitsData",
    "Metrics",
    "TrainLog",
    "bundled_model_file",
    "check_adapter_roundtrip",
    "check_rewritten_model",
    "demo_config",
    "evaluate",
    "finetune_lora",
    "load_digits_domains",
    "load_model_class",
    "plot_loss_curve",
    "pretrain_base",
    "rewrite_model_file",
    "rotate",
    "run_demo",
    "summary_table",
]

MODEL_FILE_NAME = "digits_model.py"
MODEL_CLASS_NAME = "DigitsNet"
# LoRA on the feature extractor and the hidden layer; the classifier head is trained fully.
TARGET_MODULES = ("conv1", "conv2", "fc")
MODULES_TO_SAVE = ("head",)
# Outputs of two computations of the same model in fp32 agree to rounding; this is far above it.
MATCH_TOLERANCE = 1e-4


class DemoError(RuntimeError):
    """A demo stage failed; the message names the stage and what went wrong."""


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """Settings of one demo run. ``quick`` shortens both trainings (for CI) unless steps are given."""

    steps: int | None = None
    pretrain_steps: int | None = None
    rank: int = 8
    output: Path = Path("loragen-demo")
    device: str = "cpu"
    seed: int = 0
    batch_size: int = 64
    lr: float = 3e-3
    eight_bit: bool = False
    quick: bool = False
    progress: bool = True

    @property
    def finetune_steps(self) -> int:
        """LoRA fine-tuning steps actually run."""
        return self.steps if self.steps is not None else (100 if self.quick else 300)

    @property
    def base_steps(self) -> int:
        """Pretraining steps actually run."""
        return self.pretrain_steps if self.pretrain_steps is not None else (150 if self.quick else 400)


@dataclasses.dataclass(frozen=True)
class DigitsData:
    """Train/test tensors of both domains: images ``(N, 1, 8, 8)`` float32 in [0, 1], labels ``(N,)``."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    shifted_train_x: torch.Tensor
    shifted_test_x: torch.Tensor

    def to(self, device: torch.device | str) -> DigitsData:
        """The same data on ``device``."""
        return DigitsData(*(t.to(device) for t in dataclasses.astuple(self)))


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Mean cross-entropy loss and accuracy (0..1) of a model on one test set."""

    loss: float
    accuracy: float


@dataclasses.dataclass(frozen=True)
class TrainLog:
    """Per-step training losses, wall time and the optimizer's state size in bytes."""

    losses: list[float]
    seconds: float
    optimizer_state_bytes: int

    @property
    def steps_per_second(self) -> float:
        """Training throughput."""
        return len(self.losses) / self.seconds if self.seconds > 0 else float("inf")


@dataclasses.dataclass(frozen=True)
class AdapterCheck:
    """Largest output differences (logits, max-abs) found by :func:`check_adapter_roundtrip`."""

    adapter_dir: Path
    reload_max_diff: float
    merge_max_diff: float

    @property
    def ok(self) -> bool:
        """Both differences are within :data:`MATCH_TOLERANCE`."""
        return max(self.reload_max_diff, self.merge_max_diff) <= MATCH_TOLERANCE


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What :func:`run_demo` measured and wrote."""

    base_source: Metrics
    base_shifted: Metrics
    lora_shifted: Metrics
    lora_source: Metrics
    trainable: int
    total: int
    train_log: TrainLog
    adapter: AdapterCheck
    rewritten_max_diff: float
    diff: str
    summary_path: Path
    plot_path: Path

    @property
    def ok(self) -> bool:
        """The fine-tune improved the shifted-domain accuracy and every consistency check passed."""
        return (
            self.lora_shifted.accuracy > self.base_shifted.accuracy
            and self.adapter.ok
            and self.rewritten_max_diff <= MATCH_TOLERANCE
        )


# ---- stage 1: the model file and its rewrite ----------------------------------------------------


def bundled_model_file() -> Path:
    """Path of the bundled ``digits_model.py``: from the installed package, else the checkout's ``examples/``.

    Raises:
        DemoError: neither location has the file.
    """
    try:
        packaged = resources.files("loragen._examples").joinpath(MODEL_FILE_NAME)
        if packaged.is_file():
            return Path(str(packaged))
    except ModuleNotFoundError:
        pass
    in_repo = Path(__file__).resolve().parent.parent / "examples" / MODEL_FILE_NAME
    if in_repo.is_file():
        return in_repo
    raise DemoError(
        f"cannot find the bundled model file {MODEL_FILE_NAME}: looked in the package loragen._examples "
        f"and in {in_repo.parent}; run the demo from a loragen checkout or reinstall loragen"
    )


def load_model_class(source: str, module_name: str, filename: str) -> type[nn.Module]:
    """Execute a model file's ``source`` as module ``module_name`` and return its ``DigitsNet`` class.

    Raises:
        DemoError: the source does not define ``DigitsNet``.
    """
    module = types.ModuleType(module_name)
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own bundled example
    cls = module.__dict__.get(MODEL_CLASS_NAME)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise DemoError(f"{filename}: defines no nn.Module class {MODEL_CLASS_NAME!r}")
    return cls


def demo_config(rank: int) -> LoraConfig:
    """The demo's adapter: rank ``rank``, ``lora_alpha = 2 * rank``, head trained fully."""
    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(TARGET_MODULES),
        modules_to_save=list(MODULES_TO_SAVE),
    )


def rewrite_model_file(path: Path, config: LoraConfig) -> tuple[str, str]:
    """Rewrite the model file at ``path`` with ``loragen.rewrite_source``.

    Returns:
        ``(new_source, unified_diff)``.

    Raises:
        DemoError: the rewriter reported errors or changed nothing.
    """
    from loragen import rewrite_source  # libcst is imported only when the demo gets here

    code = path.read_text(encoding="utf-8")
    result = rewrite_source(code, config, filename=str(path))
    errors = list(getattr(result, "errors", ()) or ())
    if errors:
        raise DemoError(f"rewrite of {path} failed: " + "; ".join(map(str, errors)))
    new_code = result.code
    if new_code == code:
        raise DemoError(
            f"rewrite of {path} changed nothing; expected {', '.join(TARGET_MODULES)} to become LoRA layers"
        )
    diff = "".join(
        difflib.unified_diff(
            code.splitlines(keepends=True),
            new_code.splitlines(keepends=True),
            fromfile=f"a/{path.name}",
            tofile=f"b/{path.name}",
        )
    )
    return new_code, diff


# ---- stage 2: data ----------------------------------------------------------------------------------


def rotate(images: torch.Tensor) -> torch.Tensor:
    """The shifted domain: images ``(N, 1, 8, 8)`` rotated 90 degrees counter-clockwise."""
    return torch.rot90(images, 1, dims=(-2, -1)).contiguous()


def load_digits_domains(seed: int, test_fraction: float = 0.25) -> DigitsData:
    """scikit-learn's 1,797 handwritten digits, split (seeded) into train and test, in both domains.

    Raises:
        DemoError: scikit-learn is not installed (``pip install 'loragen[demo]'``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DemoError("the demo needs scikit-learn: pip install 'loragen[demo]'") from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    train, test = order[n_test:], order[:n_test]
    return DigitsData(
        train_x=images[train],
        train_y=labels[train],
        test_x=images[test],
        test_y=labels[test],
        shifted_train_x=rotate(images[train]),
        shifted_test_x=rotate(images[test]),
    )


# ---- stages 3 and 4: training --------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> Metrics:
    """Loss and accuracy of ``model`` in eval mode (its training mode is restored afterwards)."""
    was_training = model.training
    model.eval()
    logits = model(images)
    model.train(was_training)
    return Metrics(F.cross_entropy(logits, labels).item(), (logits.argmax(1) == labels).float().mean().item())


def _train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    description: str | None,
) -> TrainLog:
    generator = torch.Generator().manual_seed(seed)
    model.train()
    bar: Any = range(steps)
    if description is not None:
        from tqdm.auto import tqdm

        # on a terminal the bar redraws 4 times a second; in a log (piped) a line every few seconds is enough
        interval = 0.25 if sys.stderr.isatty() else 5.0
        bar = tqdm(bar, desc=description, unit="step", dynamic_ncols=True, mininterval=interval)
    losses: list[float] = []
    start = time.perf_counter()
    for step in bar:
        index = torch.randint(0, len(labels), (batch_size,), generator=generator).to(labels.device)
        loss = F.cross_entropy(model(images[index]), labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if description is not None and (step % 10 == 0 or step == steps - 1):
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    seconds = time.perf_counter() - start
    if description is not None:
        bar.close()
    return TrainLog(losses, seconds, optimizer_state_bytes(optimizer))


def pretrain_base(
    model_cls: type[nn.Module], data: DigitsData, options: DemoOptions, device: torch.device
) -> tuple[nn.Module, TrainLog]:
    """Train a fresh ``model_cls()`` fully on the upright digits; returns it (in train mode) and its log."""
    torch.manual_seed(options.seed)
    model = model_cls().to(device)
    optimizer = make_optimizer(model, lr=options.lr)
    log = _train_loop(
        model,
        optimizer,
        data.train_x,
        data.train_y,
        steps=options.base_steps,
        batch_size=options.batch_size,
        seed=options.seed,
        description="pretrain (upright)" if options.progress else None,
    )
    return model, log


def finetune_lora(
    base: nn.Module, data: DigitsData, config: LoraConfig, options: DemoOptions
) -> tuple[nn.Module, TrainLog]:
    """Convert ``base`` in place with ``get_lora_model`` and fine-tune it on the rotated digits.

    Uses ``make_optimizer`` (AdamW over the trainable parameters; 8-bit states with ``eight_bit``).
    """
    torch.manual_seed(options.seed + 1)
    model = get_lora_model(base, config)
    optimizer = make_optimizer(model, lr=options.lr, eight_bit=options.eight_bit)
    log = _train_loop(
        model,
        optimizer,
        data.shifted_train_x,
        data.train_y,
        steps=options.finetune_steps,
        batch_size=options.batch_size,
        seed=options.seed + 1,
        description="LoRA fine-tune (rotated)" if options.progress else None,
    )
    return model, log


# ---- stages 5 and 6: adapter round trip and the rewritten model ---------------------------------


@torch.no_grad()
def _max_diff(a: nn.Module, b: nn.Module, images: torch.Tensor) -> float:
    a.eval()
    b.eval()
    return (a(images) - b(images)).abs().max().item()


def check_adapter_roundtrip(
    trained: nn.Module,
    model_cls: type[nn.Module],
    base_state: dict[str, torch.Tensor],
    adapter_dir: Path,
    images: torch.Tensor,
) -> AdapterCheck:
    """Save ``trained``'s adapter (peft format), load it into a fresh base, merge, and compare outputs.

    Args:
        trained: the fine-tuned LoRA model.
        model_cls: the plain model class; a fresh instance receives ``base_state`` and the adapter.
        base_state: the pretrained base's state dict (before conversion).
        adapter_dir: where the adapter folder is written (replaced atomically).
        images: inputs on which outputs are compared.
    """
    from loragen import load_adapter, save_adapter

    save_adapter(trained, adapter_dir)
    fresh = model_cls().to(images.device)
    fresh.load_state_dict(base_state)
    load_adapter(fresh, adapter_dir)
    reload_diff = _max_diff(trained, fresh, images)
    unmerged = fresh(images)
    merge_adapter(fresh)
    merged = fresh(images)
    return AdapterCheck(adapter_dir, reload_diff, (merged - unmerged).abs().max().item())


def check_rewritten_model(
    rewritten_cls: type[nn.Module],
    trained: nn.Module,
    base_state: dict[str, torch.Tensor],
    adapter_dir: Path,
    images: torch.Tensor,
) -> float:
    """Largest output difference between ``trained`` and the rewritten file's model given the same weights.

    The rewritten model's LoRA layers keep the base keys, so the base checkpoint loads into it
    unchanged (only the LoRA keys are missing); the adapter then fills them in.

    Raises:
        DemoError: the base checkpoint does not load into the rewritten model as the contract says.
    """
    from loragen import load_adapter

    model = rewritten_cls().to(images.device)
    result = model.load_state_dict(base_state, strict=False)
    not_lora = [key for key in result.missing_keys if ".lora_" not in key]
    if result.unexpected_keys or not_lora:
        raise DemoError(
            "the base checkpoint does not fit the rewritten model: "
            f"missing {not_lora}, unexpected {result.unexpected_keys}"
        )
    load_adapter(model, adapter_dir)
    return _max_diff(trained, model, images)


# ---- stage 7: reporting ---------------------------------------------------------------------------


def plot_loss_curve(base_log: TrainLog, lora_log: TrainLog, path: Path) -> Path:
    """Write both training-loss curves (raw and smoothed, log scale) to a PNG at ``path``, atomically.

    Raises:
        DemoError: matplotlib is not installed (``pip install 'loragen[demo]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as exc:
        raise DemoError("the demo needs matplotlib: pip install 'loragen[demo]'") from exc

    def smooth(values: list[float], window: int = 20) -> list[float]:
        out, total = [], 0.0
        for i, value in enumerate(values):
            total += value - (values[i - window] if i >= window else 0.0)
            out.append(total / min(i + 1, window))
        return out

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    offset = len(base_log.losses)
    for log, label, color, start in (
        (base_log, "pretrain, upright digits (all weights)", "tab:blue", 0),
        (lora_log, "LoRA fine-tune, rotated digits", "tab:orange", offset),
    ):
        steps = list(range(start, start + len(log.losses)))
        axes.plot(steps, log.losses, color=color, alpha=0.25, linewidth=0.8)
        axes.plot(steps, smooth(log.losses), color=color, label=label)
    axes.axvline(offset, color="gray", linestyle="--", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (log scale)")
    axes.set_title("loragen demo: training loss")
    axes.legend()
    figure.tight_layout()
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png")
    plt.close(figure)
    return path


def summary_table(result: DemoResult, options: DemoOptions) -> str:
    """A short Markdown summary of a demo run."""
    share = 100.0 * result.trainable / result.total
    rows = [
        ("base, upright test digits", result.base_source),
        ("base, rotated test digits", result.base_shifted),
        ("LoRA, rotated test digits", result.lora_shifted),
        ("LoRA, upright test digits", result.lora_source),
    ]
    lines = [
        "| model, data | accuracy | loss |",
        "|---|---:|---:|",
        *(f"| {name} | {m.accuracy:.1%} | {m.loss:.4f} |" for name, m in rows),
        "",
        "| run | value |",
        "|---|---|",
        (
            f"| LoRA rank / alpha | {options.rank} / {2 * options.rank} on {', '.join(TARGET_MODULES)}; "
            f"{', '.join(MODULES_TO_SAVE)} trained fully |"
        ),
        f"| trainable parameters | {result.trainable:,} of {result.total:,} ({share:.2f}%) |",
        (
            f"| fine-tune | {len(result.train_log.losses)} steps, "
            f"{result.train_log.steps_per_second:.1f} steps/s |"
        ),
        (
            f"| optimizer state | {result.train_log.optimizer_state_bytes:,} bytes "
            f"({'8-bit AdamW' if options.eight_bit else 'AdamW'}) |"
        ),
        f"| adapter reloaded into a fresh base, max abs diff | {result.adapter.reload_max_diff:.2e} |",
        f"| merged vs unmerged, max abs diff | {result.adapter.merge_max_diff:.2e} |",
        f"| rewritten model file vs runtime conversion, max abs diff | {result.rewritten_max_diff:.2e} |",
        f"| seed / device | {options.seed} / {options.device} |",
    ]
    return "\n".join(lines) + "\n"


# ---- the whole job ----------------------------------------------------------------------------------


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DemoError(f"--device {name}: CUDA is not available here; use --device cpu")
    return device


def run_demo(options: DemoOptions, out: TextIO | None = None) -> DemoResult:
    """Run every stage; write ``summary.md``, ``loss_curve.png``, ``metrics.json``, the rewritten model file
    and ``adapter/`` under ``options.output``; report each stage to ``out`` (nothing when it is ``None``).

    Raises:
        DemoError: a stage failed (scikit-learn or matplotlib missing, rewrite failed, CUDA unavailable).
    """

    def say(text: str) -> None:
        if out is not None:
            out.write(text + "\n")
            out.flush()

    device = _resolve_device(options.device)
    output = Path(options.output)
    output.mkdir(parents=True, exist_ok=True)
    config = demo_config(options.rank)

    model_path = bundled_model_file()
    say(
        f"== 1. loragen rewrite {model_path.name} "
        f"(r={options.rank}, target_modules={','.join(TARGET_MODULES)})"
    )
    base_cls = load_model_class(
        model_path.read_text(encoding="utf-8"), "loragen_demo_digits_model", str(model_path)
    )
    new_code, diff = rewrite_model_file(model_path, config)
    say(diff)
    rewritten_path = output / f"{model_path.stem}_lora.py"
    atomic_write_text(rewritten_path, new_code)
    rewritten_cls = load_model_class(new_code, "loragen_demo_digits_model_lora", str(rewritten_path))

    data = load_digits_domains(options.seed).to(device)
    say(
        f"== 2. data: scikit-learn digits, {len(data.train_y)} train / {len(data.test_y)} test; "
        "shifted domain = rotated 90 degrees"
    )

    say(f"== 3. pretrain the base on upright digits ({options.base_steps} steps)")
    base, base_log = pretrain_base(base_cls, data, options, device)
    base_source = evaluate(base, data.test_x, data.test_y)
    base_shifted = evaluate(base, data.shifted_test_x, data.test_y)
    say(f"   base accuracy: upright {base_source.accuracy:.1%}, rotated {base_shifted.accuracy:.1%}")
    base_state = {key: value.detach().clone() for key, value in base.state_dict().items()}

    say(f"== 4. LoRA fine-tune on rotated digits ({options.finetune_steps} steps)")
    model, lora_log = finetune_lora(base, data, config, options)
    trainable, total = count_parameters(model.parameters())
    lora_shifted = evaluate(model, data.shifted_test_x, data.test_y)
    lora_source = evaluate(model, data.test_x, data.test_y)
    say(f"   trainable parameters: {trainable:,} of {total:,} ({100.0 * trainable / total:.2f}%)")
    say(
        f"   rotated-digit accuracy: {base_shifted.accuracy:.1%} -> {lora_shifted.accuracy:.1%} "
        f"(loss {base_shifted.loss:.3f} -> {lora_shifted.loss:.3f}); {lora_log.steps_per_second:.1f} steps/s"
    )

    say("== 5. save the adapter (peft format), reload into a fresh base, merge")
    adapter = check_adapter_roundtrip(model, base_cls, base_state, output / "adapter", data.shifted_test_x)
    say(
        f"   {adapter.adapter_dir}: reload max diff {adapter.reload_max_diff:.2e}, "
        f"merged vs unmerged {adapter.merge_max_diff:.2e} -> {'OK' if adapter.ok else 'MISMATCH'}"
    )

    say("== 6. the rewritten model file + base checkpoint + adapter")
    rewritten_diff = check_rewritten_model(
        rewritten_cls, model, base_state, adapter.adapter_dir, data.shifted_test_x
    )
    say(
        f"   max diff vs the trained model {rewritten_diff:.2e} -> "
        f"{'OK' if rewritten_diff <= MATCH_TOLERANCE else 'MISMATCH'}"
    )

    plot_path = plot_loss_curve(base_log, lora_log, output / "loss_curve.png")
    result = DemoResult(
        base_source=base_source,
        base_shifted=base_shifted,
        lora_shifted=lora_shifted,
        lora_source=lora_source,
        trainable=trainable,
        total=total,
        train_log=lora_log,
        adapter=adapter,
        rewritten_max_diff=rewritten_diff,
        diff=diff,
        summary_path=output / "summary.md",
        plot_path=plot_path,
    )
    table = summary_table(result, options)
    atomic_write_text(result.summary_path, "# loragen demo\n\n" + table)
    metrics = {
        "base_source": dataclasses.asdict(base_source),
        "base_shifted": dataclasses.asdict(base_shifted),
        "lora_shifted": dataclasses.asdict(lora_shifted),
        "lora_source": dataclasses.asdict(lora_source),
        "trainable": trainable,
        "total": total,
        "pretrain_losses": base_log.losses,
        "finetune_losses": lora_log.losses,
        "optimizer_state_bytes": lora_log.optimizer_state_bytes,
        "options": {k: str(v) for k, v in dataclasses.asdict(options).items()},
    }
    atomic_write_text(output / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    say("== 7. summary")
    say(table)
    say(
        f"wrote {result.summary_path}, {plot_path}, {output / 'metrics.json'}, {rewritten_path}, "
        f"{adapter.adapter_dir}/"
    )
    return result
