"""The demo's figure: training loss and test accuracy over both phases, the phases shaded and labelled."""

from __future__ import annotations

from pathlib import Path

from loragen.atomic import atomic_file

from .options import MODULES_TO_SAVE, TARGET_MODULES, DemoError, DemoOptions
from .training import TrainLog

__all__ = ["FIGURE_NAME", "plot_training"]

FIGURE_NAME = "training_curves.png"

_UPRIGHT, _ROTATED = "tab:blue", "tab:orange"


def _smooth(values: list[float], window: int = 20) -> list[float]:
    """Trailing moving average (the first values average what there is)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_training(base_log: TrainLog, lora_log: TrainLog, options: DemoOptions, path: Path) -> Path:
    """Write the figure to a PNG at ``path``, atomically; returns ``path``.

    Top: the training loss of every step (faint) and its moving average (log scale). Bottom: test
    accuracy on upright and on rotated digits. The x axis counts steps over both phases; the phases
    (pretraining on upright digits, LoRA fine-tuning on rotated digits) are shaded and labelled.

    Raises:
        DemoError: matplotlib is not installed (``pip install -e '.[demo]'`` from the loragen checkout).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as exc:
        raise DemoError(
            "the demo needs matplotlib: pip install -e '.[demo]' (from the loragen checkout)"
        ) from exc

    offset = len(base_log.losses)
    end = offset + len(lora_log.losses)
    figure, (loss_axes, acc_axes) = plt.subplots(
        2, 1, figsize=(9, 6.5), dpi=100, sharex=True, gridspec_kw={"height_ratios": [1, 1.2]}
    )
    phases = (
        (0, offset, "#e8eef7", "pretraining: upright digits\n(all weights train)"),
        (
            offset,
            end,
            "#fbeee0",
            f"LoRA fine-tuning: rotated digits\n(r={options.r} on {', '.join(TARGET_MODULES)}; "
            f"{', '.join(MODULES_TO_SAVE)} trains fully)",
        ),
    )
    for axes in (loss_axes, acc_axes):
        for start, stop, color, _ in phases:
            axes.axvspan(start, stop, color=color, zorder=0)
        axes.axvline(offset, color="gray", linestyle="--", linewidth=0.8)
        axes.grid(alpha=0.3)
        axes.set_xlim(0, end)
    for start, stop, _, label in phases:
        loss_axes.text(
            (start + stop) / 2,
            1.02,
            label,
            transform=loss_axes.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=9,
        )

    # training loss: each phase on its own domain, so one colour per domain
    for log, start, color in ((base_log, 0, _UPRIGHT), (lora_log, offset, _ROTATED)):
        steps = list(range(start + 1, start + len(log.losses) + 1))
        loss_axes.plot(steps, log.losses, color=color, alpha=0.25, linewidth=0.8)
        loss_axes.plot(steps, _smooth(log.losses), color=color, linewidth=1.6)
    loss_axes.set_yscale("log")
    loss_axes.set_ylabel("training loss\n(cross-entropy, log)")
    loss_axes.plot([], [], color=_UPRIGHT, label="on upright digits (pretraining)")
    loss_axes.plot([], [], color=_ROTATED, label="on rotated digits (LoRA)")
    loss_axes.legend(loc="upper right", fontsize=8)

    for domain, color in (("upright", _UPRIGHT), ("rotated", _ROTATED)):
        xs, ys = [], []
        for log, start in ((base_log, 0), (lora_log, offset)):
            for point in log.evals:
                xs.append(start + point.step)
                ys.append(100.0 * getattr(point, domain).accuracy)
        acc_axes.plot(
            xs, ys, color=color, marker="o", markersize=2.5, linewidth=1.4, label=f"{domain} test digits"
        )
        acc_axes.annotate(
            f"{ys[-1]:.1f}%",
            (xs[-1], ys[-1]),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color=color,
        )
    acc_axes.set_ylim(0, 100)
    acc_axes.set_ylabel("test accuracy (%)")
    acc_axes.set_xlabel("training step (pretraining, then LoRA fine-tuning)")
    acc_axes.legend(loc="center left", fontsize=8)
    figure.suptitle("loragen demo: adapting a digit classifier to rotated digits with LoRA", y=0.995)
    figure.tight_layout()
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png")
    plt.close(figure)
    return path
