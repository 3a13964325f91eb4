"""Self-check of each kernel variant on its first use on a device, and the fallback to the torch path.

loragen's CUDA kernels cannot be run where they are developed (no GPU), so they prove themselves where
they first run. :class:`CheckedLauncher` (the default launcher of :func:`loragen.cuda.lora_linear_cuda`)
is asked by each forward which launcher runs its variant -- (dtype, rank bucket, alignment) -- on its
device. On the first ask per variant and device in a process it runs the variant's four passes (the
kernels the op launches for it) on a small problem with odd sizes, an
odd rank, dropout, and x and g given as views at a storage offset (for an unaligned variant the pointers
are then not 16-byte aligned), and compares every output with the torch path
(:mod:`loragen.cuda.torch_kernels`) on the same inputs.

Any failure -- NVRTC missing, an architecture NVRTC does not know, bfloat16 on a GPU older than sm_80,
a compile error, a module the driver will not load, a launch error, or numbers that differ -- gives one
``RuntimeWarning`` naming the variant, the device and the reason, and that variant runs on the torch
path (cuBLAS products, the same hand-written backward) for the rest of the process. A later launch
error of a checked variant does the same. On a GPU the check first runs in a child process
(:mod:`loragen.cuda.isolated`): a kernel that faults (a sticky error that would leave the CUDA context
unusable, for the torch path too) takes only the child down, and its variant falls back. :func:`CheckedLauncher.outcomes` lists what was decided.

:data:`loragen.switches.cuda_kernels` (``LORAGEN_CUDA_KERNELS``) chooses per call:

========= ==============================================================================================
``check`` (default) check on first use, fall back on failure
``trust`` the kernels run unchecked; their errors raise (for kernel development and measurements)
``torch`` every variant runs on the torch path; the kernels are never compiled or launched
========= ==============================================================================================
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from loragen import philox, switches
from loragen.cuda import passes, streams
from loragen.cuda.check_numerics import autocast_off, exact_float32_products
from loragen.cuda.isolated import DRIVER_LAUNCHER, check_in_child
from loragen.cuda.kernel_variants import Variant, rank_bucket
from loragen.cuda.launch import CudaDriverError, KernelLauncher, default_launcher
from loragen.cuda.nvrtc import KernelCompileError, NvrtcUnavailableError
from loragen.cuda.specs import KernelSpec
from loragen.cuda.torch_kernels import TorchKernels

__all__ = ["OK", "CheckedLauncher", "check_variant", "child_main", "default_checker"]

OK = "ok"
# largest |kernel - torch path| relative to the largest |torch path| value, by the variant's dtype. Both
# sides read the same inputs and accumulate in float32; they differ by summation order, by the rounding
# of 16-bit outputs (2**-8 for bfloat16, 2**-11 for float16), and where a kernel runs on tensor cores,
# by A or B^T rounded to the 16-bit dtype (seen: 1.5e-3 for bfloat16, 2.3e-4 for float16 at R = 32-64).
BOUNDS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_TORCH_DTYPES = {name: dtype for dtype, name in passes.DTYPE_NAMES.items()}
_SEED = 0x0123_4567_89AB_CDEF  # both key words non-zero
_OFFSET = 0x0000_0005_0000_0003  # both counter words non-zero
_P = 0.25


def _shape(variant: Variant) -> tuple[int, int, int, int]:
    """rows, in, out, rank of the check problem: odd rows and rank, partial tiles everywhere."""
    rank = max(1, variant.rank_bucket - 3)
    if variant.aligned:
        return 67, 264, 136, rank
    return 67, 263, 133, rank


def _offset_view(values: Tensor, dtype: torch.dtype, device: torch.device, aligned: bool) -> Tensor:
    """``values`` as a contiguous view at a storage offset: 16 bytes in (aligned) or one element in
    (the data pointer is then not 16-byte aligned)."""
    element = torch.empty((), dtype=dtype).element_size()
    offset = 16 // element if aligned else 1
    storage = torch.zeros(values.numel() + offset, dtype=dtype, device=device)
    view = storage[offset:].view(values.shape)
    view.copy_(values)
    return view


def _problem(variant: Variant, device: torch.device) -> dict[str, Tensor]:
    rows, cols_in, cols_out, rank = _shape(variant)
    gen = torch.Generator().manual_seed(16)
    dtype = _TORCH_DTYPES[variant.dtype]
    return {
        "x": _offset_view(torch.randn(rows, cols_in, generator=gen), dtype, device, variant.aligned),
        "g": _offset_view(torch.randn(rows, cols_out, generator=gen), dtype, device, variant.aligned),
        "a": (torch.randn(rank, cols_in, generator=gen) / cols_in**0.5).to(device),
        "bt": torch.randn(rank, cols_out, generator=gen).to(device),
        "bias": torch.randn(cols_out, generator=gen).to(device=device, dtype=dtype),
    }


def _run(
    variant: Variant, launcher: KernelLauncher, data: dict[str, Tensor], given: dict[str, Tensor] | None
) -> dict[str, Tensor]:
    """The four passes on ``data``; each pass reads the outputs in ``given`` (the torch path's) when
    provided, so a wrong pass is named by its own outputs only."""
    x, g = data["x"], data["g"]
    rank = data["a"].shape[0]
    plan = passes.Plan(x, g.shape[1], rank, launcher)
    if plan.variant != variant:  # pragma: no cover - the problem is built for the variant
        raise AssertionError(f"self-check problem has variant {plan.variant.label}, not {variant.label}")
    x2, g2 = plan.prepare(x), plan.prepare(g)
    a32 = plan.prepare(passes.pad_rank(data["a"], variant))  # as the op passes them: (R, in), (R, out)
    bt32 = plan.prepare(passes.pad_rank(data["bt"], variant))
    # seed and offset in device memory, as the op passes them; both non-zero so both words are read
    rng = torch.tensor([_SEED, _OFFSET], dtype=torch.int64, device=x.device)
    dropout = (rng, philox.keep_threshold(_P), philox.keep_scale(_P))
    h = passes.down(plan, x2, a32, dropout)
    h_in = h if given is None else given["h"]
    term = g.clone()  # lora_up adds onto what is there (the base product in the op): any finite values
    passes.up(plan, h_in, bt32, data["bias"], 0.75, term)
    dh, db = passes.grad_out(plan, g2, h_in, bt32, 0.75)
    dh_in = dh if given is None else given["dh"]
    gx, da = passes.grad_in(plan, x2, dh_in, a32, dropout, True)
    assert gx is not None  # need_x=True
    return {
        "h": h,
        "lora_down h": h[:, :rank],
        "lora_up out + bias + s h B^T": term,
        "dh": dh,
        "lora_grad_out dh": dh[:, :rank],
        "lora_grad_out dB": db[:, :rank],
        "lora_grad_in dx": gx,
        "lora_grad_in dA": da[:rank],
    }


def _stage(exc: BaseException) -> str:
    if isinstance(exc, NvrtcUnavailableError):
        return "NVRTC unavailable"
    if isinstance(exc, KernelCompileError):
        return "compile"
    text = str(exc)
    if isinstance(exc, CudaDriverError):
        return "load" if "cuModule" in text else "launch" if "cuLaunchKernel" in text else "driver"
    if "nvrtc" in text.lower():
        return "compile"
    return type(exc).__name__


def _summary(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines[1:] if "error" in line.lower()]
    text = "; ".join(lines[:1] + errors[:1]) or type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def check_variant(
    variant: Variant, device: torch.device, kernels: KernelLauncher, torch_path: KernelLauncher | None = None
) -> str | None:
    """Run ``variant``'s passes through ``kernels`` on the self-check problem on ``device`` and compare
    them with the torch path; None when they agree, else the reason (stage and message).

    ``kernels`` may have an ``arch(device)`` method (``"sm_90"``); bfloat16 then needs sm_80 or newer.
    Both sides run with full float32 products and without autocast, whatever the caller set
    (:mod:`loragen.cuda.check_numerics`).
    """
    arch_of = getattr(kernels, "arch", None)
    if variant.dtype == "bfloat16" and arch_of is not None:
        arch = str(arch_of(device))
        digits = "".join(c for c in arch if c.isdigit())
        if digits and int(digits) < 80:
            return f"unsupported: bfloat16 kernels need sm_80 or newer, {device} is {arch}"
    with torch.no_grad(), exact_float32_products(), autocast_off(device):
        data = _problem(variant, device)
        want = _run(variant, torch_path or TorchKernels(), data, None)
        try:
            got = _run(variant, kernels, data, want)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # any failure means: this variant does not run here
            return f"{_stage(exc)}: {_summary(exc)}"
        for name, expected in want.items():
            if name in ("h", "dh"):
                continue
            actual = got[name].float()
            bound = BOUNDS[_TORCH_DTYPES[variant.dtype]]
            scale = expected.float().abs().max().item()
            error = (actual - expected.float()).abs().max().item() / max(scale, 1e-30)
            if not error <= bound:  # NaN fails too
                return (
                    f"numeric: {name} differs from the torch path by {error:.3g} of its largest value "
                    f"(bound {bound:g} for {variant.dtype}) on the check problem "
                    f"{'x'.join(map(str, _shape(variant)))} (rows x in x out x rank)"
                )
        # the columns past the rank are read by the next pass against zero rows (NaN * 0 is NaN): exact zeros
        rank = data["a"].shape[0]
        for name, kernel in (("h", "lora_down"), ("dh", "lora_grad_out")):
            padding = got[name][:, rank:]
            if bool(padding.ne(0).any()):
                return (
                    f"numeric: {kernel} left non-zero values in {name}'s columns past the rank "
                    f"({rank} of {variant.rank_bucket}), which the next pass reads"
                )
    return None


def _keyed(device: torch.device | str) -> torch.device:
    """``device`` as the checker keys its decisions: a CUDA device without an index is the current one, as
    on the op's tensors (so ``check_all("cuda")`` covers the op's calls on ``cuda:N``). Other devices are
    kept as given: the tests emulate launches on ``cpu`` and ``cpu:0`` as two devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _Guarded:
    """A checked variant's kernels; a launch error moves the variant to the torch path (one warning)."""

    def __init__(self, checker: CheckedLauncher, key: tuple[Variant, str]) -> None:
        self._checker = checker
        self._key = key

    def target_blocks(self, device: torch.device) -> int:
        return self._checker.kernels.target_blocks(device)

    def launch(
        self,
        spec: KernelSpec,
        variant: Variant,
        grid: tuple[int, int],
        args: Sequence[object],
        device: torch.device,
    ) -> None:
        if self._checker.outcome(*self._key) == OK:
            try:
                self._checker.kernels.launch(spec, variant, grid, args, device)
                return
            except Exception as exc:
                self._checker.fail(*self._key, f"{_stage(exc)} ({spec.name}): {_summary(exc)}")
        self._checker.torch_path.launch(spec, variant, grid, args, device)


class CheckedLauncher:
    """Chooses, per kernel variant and device, between the kernels and the torch path; see the module
    docstring. ``kernels`` defaults to :func:`loragen.cuda.launch.default_launcher` (made on first use)."""

    def __init__(
        self,
        kernels: KernelLauncher | None = None,
        torch_path: KernelLauncher | None = None,
        *,
        isolate: bool | None = None,
        child_launcher: str = DRIVER_LAUNCHER,
    ) -> None:
        """``isolate``: check in a child process first (:mod:`loragen.cuda.isolated`); default: on CUDA
        devices when ``kernels`` is the default driver launcher. ``child_launcher`` ("module:callable")
        makes the child's launcher."""
        self._kernels = kernels
        self.torch_path: KernelLauncher = torch_path or TorchKernels()
        self._isolate = isolate if isolate is not None else (None if kernels is None else False)
        self._child_launcher = child_launcher
        self._outcomes: dict[tuple[Variant, str], str] = {}
        self._lock = threading.RLock()
        # (variant, torch.device) -> the launcher route() returns; written under the lock, read without
        self._routes: dict[tuple[Variant, torch.device], KernelLauncher] = {}

    @property
    def kernels(self) -> KernelLauncher:
        """The launcher that runs the compiled kernels."""
        if self._kernels is None:
            self._kernels = default_launcher()
        return self._kernels

    def outcome(self, variant: Variant, device: torch.device | str) -> str | None:
        """``"ok"``, the reason the variant runs on the torch path, or None when not checked yet
        (``"cuda"``: the current CUDA device)."""
        # the guarded launches ask with the name the decision is kept under: one lookup, nothing built
        found = self._outcomes.get((variant, str(device)))
        return found if found is not None else self._outcomes.get((variant, str(_keyed(device))))

    def outcomes(self) -> dict[str, str]:
        """Every decision so far: ``{"bfloat16-r16-aligned on cuda:0": "ok" or the reason}``."""
        with self._lock:
            return {
                f"{variant.label} on {device}": text for (variant, device), text in self._outcomes.items()
            }

    def fail(self, variant: Variant, device: torch.device | str, reason: str) -> None:
        """Move ``variant`` on ``device`` to the torch path, with one warning (later calls change nothing)."""
        device = str(_keyed(device))
        with self._lock:
            if self._outcomes.get((variant, device), OK) != OK:
                return
            self._outcomes[(variant, device)] = reason
            for routed_key in [k for k in self._routes if k[0] == variant and str(k[1]) == device]:
                self._routes[routed_key] = self.torch_path
        warnings.warn(
            f"loragen.cuda: kernel variant {variant.label} on {device} runs on the torch path (cuBLAS) for "
            f"the rest of this process: {reason}. LORAGEN_CUDA_KERNELS=torch uses the torch path "
            "without checking; please report this with the output of scripts/first_gpu_run.sh.",
            RuntimeWarning,
            stacklevel=4,
        )

    def route(self, variant: Variant, device: torch.device) -> KernelLauncher:
        """The launcher that runs ``variant`` on ``device`` now (checking it first when it is new); a CUDA
        device without an index is the current one.

        Raises:
            RuntimeError: the variant has not been checked yet and a CUDA graph is being captured.
        """
        mode = switches.cuda_kernels.get()
        if mode == "torch":
            return self.torch_path
        if mode == "trust":
            return self.kernels
        # fast path after a variant's first use: one dict lookup, no lock, nothing allocated
        routed = self._routes.get((variant, device))
        if routed is not None:
            return routed
        device = _keyed(device)
        key = (variant, str(device))
        with self._lock:
            routed = self._routes.get((variant, device))
            if routed is not None:  # asked as "cuda" after a use as cuda:N, or routed by another thread
                return routed
            if key not in self._outcomes:
                if streams.capturing(device):
                    raise RuntimeError(
                        f"loragen.cuda: kernel variant {variant.label} is used for the first time on {device} "
                        "while a CUDA graph is being captured; run one step before capturing (as PyTorch's "
                        "graph warm-up does) so that it can be checked outside the capture"
                    )
                isolate = self._isolate if self._isolate is not None else device.type == "cuda"
                reason = check_in_child(variant, device, self._child_launcher) if isolate else None
                if reason is None:
                    reason = check_variant(variant, device, self.kernels, self.torch_path)
                if reason is None:
                    self._outcomes[key] = OK
                else:
                    self.fail(variant, device, reason)
            routed = _Guarded(self, key) if self._outcomes[key] == OK else self.torch_path
            self._routes[(variant, device)] = routed
        return routed

    def check_all(self, device: torch.device, variants: Sequence[Variant] | None = None) -> dict[str, str]:
        """Check every variant (or ``variants``) on ``device`` now (``"cuda"``: the current CUDA device);
        :meth:`outcomes` afterwards."""
        for variant in variants or all_lora_variants():
            self.route(variant, device)
        return self.outcomes()

    # a KernelLauncher too, for callers that launch without routing first
    def target_blocks(self, device: torch.device) -> int:
        return self.kernels.target_blocks(device)

    def launch(
        self,
        spec: KernelSpec,
        variant: Variant,
        grid: tuple[int, int],
        args: Sequence[object],
        device: torch.device,
    ) -> None:
        self.route(variant, device).launch(spec, variant, grid, args, device)


def all_lora_variants() -> list[Variant]:
    """Every (dtype, rank bucket, alignment) the LoRA op can ask for."""
    from loragen.cuda.kernel_variants import DTYPES, RANK_BUCKETS

    return [Variant(d, rank_bucket(b), a) for d in DTYPES for b in RANK_BUCKETS for a in (True, False)]


_default: CheckedLauncher | None = None
_default_lock = threading.Lock()


def default_checker() -> CheckedLauncher:
    """The process-wide :class:`CheckedLauncher` around the CUDA driver launcher."""
    global _default
    with _default_lock:
        if _default is None:
            _default = CheckedLauncher()
        return _default


def child_main(argv: list[str]) -> int:
    """The child side of :func:`loragen.cuda.isolated.check_in_child`:
    ``DTYPE BUCKET aligned|unaligned DEVICE_INDEX MODULE:LAUNCHER`` (index -1: the CPU); writes one JSON
    line ``{"reason": ...}`` to stdout."""
    dtype, bucket, alignment, index, launcher_path = argv
    module, _, attribute = launcher_path.partition(":")
    launcher = getattr(importlib.import_module(module), attribute)()
    device = torch.device("cpu") if int(index) < 0 else torch.device("cuda", int(index))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    reason = check_variant(Variant(dtype, int(bucket), alignment == "aligned"), device, launcher)
    sys.stdout.write(json.dumps({"reason": reason}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
