"""Each kernel variant checked on its first use on a device, and the torch products it falls back to.

:class:`CheckedLauncher` (the default launcher of :func:`loragen.cuda.lora_linear_cuda`) runs a new
variant's four passes on a small problem with odd sizes, an odd rank, dropout and offset pointers, and
compares them with :class:`TorchKernels` (the same computation as torch products) in full float32 and
without autocast; on a GPU first in a child process, so a kernel that faults takes only the child down.
Any failure gives one ``RuntimeWarning`` naming the variant, the device and the reason, and the variant
runs on the torch route for the rest of the process (a later launch error does the same).

:data:`loragen.switches.cuda_kernels` (``LORAGEN_CUDA_KERNELS``): ``check`` (default) as above;
``trust`` runs the kernels unchecked, their errors raise (kernel development, sanitizers, profiling);
``torch`` runs every variant on the torch route, never compiling or launching a kernel.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from loragen import philox, switches
from loragen.cuda import kernels, launch
from loragen.cuda.build import KernelCompileError, NvrtcUnavailableError
from loragen.cuda.kernels import Grid, KernelLauncher, KernelSpec, Variant
from loragen.cuda.launch import CudaDriverError, default_launcher

__all__ = [
    "BLOCK_ELEMENTS",
    "CheckedLauncher",
    "OK",
    "TorchKernels",
    "check_in_child",
    "check_variant",
    "child_main",
    "default_checker",
    "exact_float32_products",
    "rng_values",
]

# ---- what the check computes under ----------------------------------------------------------------

# torch >= 2.9 keeps a float32 precision per backend as well (``fp32_precision``, "none": as above)
_PER_BACKEND_PRECISION = hasattr(torch.backends.cuda.matmul, "fp32_precision")


@contextlib.contextmanager
def exact_float32_products() -> Iterator[None]:
    """Float32 matrix products in full float32 inside the block (no TF32, no bfloat16 passes), and every
    precision setting back as it was found afterwards.

    The process-wide setting goes to ``"highest"`` (unless reading it raises: per-backend settings that
    disagree) and, on torch >= 2.9, cuBLAS's and oneDNN's ``fp32_precision`` to ``"ieee"``, so every
    reading answers inside the block without raising. The legacy ``allow_tf32`` flag is never set
    (mixing the two APIs can make :func:`torch.get_float32_matmul_precision` raise for good).
    """
    try:
        process_wide: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        process_wide = None
    settings: list[Any] = []
    if _PER_BACKEND_PRECISION:  # cuBLAS's on a GPU, oneDNN's on the CPU (emulated kernels in tests)
        settings.append(torch.backends.cuda.matmul)
        onednn = getattr(torch.backends.mkldnn, "matmul", None)
        if hasattr(onednn, "fp32_precision"):
            settings.append(onednn)
    found = [setting.fp32_precision for setting in settings]
    try:
        if process_wide is not None:
            torch.set_float32_matmul_precision("highest")
        for setting in settings:
            setting.fp32_precision = "ieee"
        yield
    finally:
        if process_wide is not None:
            torch.set_float32_matmul_precision(process_wide)
        for setting, value in zip(settings, found):
            setting.fp32_precision = value


@contextlib.contextmanager
def autocast_off(device: torch.device) -> Iterator[None]:
    """No autocast inside the block for ``device``'s type or for the CPU (where the check builds its
    problem), whichever the caller had on."""
    with contextlib.ExitStack() as stack:
        for device_type in dict.fromkeys(("cpu", device.type)):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


# ---- TorchKernels: each kernel's computation as torch products ------------------------------------

# elements per row block (128 MiB of float32, so Philox temporaries stay < 1 GiB); blocks start on a
# multiple of 8 rows, so each starts on a whole Philox group
BLOCK_ELEMENTS = 1 << 25
_MASK64 = (1 << 64) - 1


def rng_values(rng: Tensor) -> tuple[int, int]:
    """The (seed, offset) pair the kernels read through their ``rng`` pointer, as unsigned 64-bit ints
    (for tests and tools: reading a CUDA tensor waits for the device)."""
    seed, offset = rng.tolist()
    return seed & _MASK64, offset & _MASK64


def _row_blocks(rows: int, cols: int) -> list[tuple[int, int]]:
    """Row ranges of at most BLOCK_ELEMENTS elements; one (empty) range for no rows."""
    step = max(8, BLOCK_ELEMENTS // max(cols, 1) // 8 * 8)
    return [(begin, min(rows, begin + step)) for begin in range(0, max(rows, 1), step)]


def _first_partial(parts: Tensor) -> Tensor:
    """Zero every partial but the first, and return the first (which then holds the whole sum)."""
    if parts.shape[0] > 1:
        parts[1:].zero_()
    return parts[0]


def _keep(rng: Tensor | None, start: int, values: Tensor, threshold: int) -> Tensor | None:
    """The Philox keep-mask of a row block whose element [0, 0] is flat element ``start`` (made on the
    device from the op's ``rng`` tensor), shaped as ``values``; None without dropout."""
    if threshold == 0 or rng is None:
        return None
    return philox.rng_keep_mask(rng, start, values.numel(), threshold).view(values.shape)


def _dropped(values: Tensor, keep: Tensor | None, keep_scale: float) -> Tensor:
    """``values`` in float32, kept elements times keep_scale, dropped ones 0 (``keep`` None: all kept)."""
    return values.float() if keep is None else torch.where(keep, values.float() * keep_scale, 0.0)


def _down(
    x: Tensor,
    lora_a: Tensor,
    h_part: Tensor,
    rows: int,
    cols: int,
    rank: int,
    cols_per_split: int,
    rng: Tensor | None,
    threshold: int,
    keep_scale: float,
) -> None:
    """h = dropout(x) A^T (rows, R) into partial 0."""
    h = _first_partial(h_part)
    for begin, end in _row_blocks(rows, cols):
        keep = _keep(rng, begin * cols, x[begin:end], threshold)
        torch.mm(_dropped(x[begin:end], keep, keep_scale), lora_a.mT, out=h[begin:end])


def _up(
    h: Tensor,
    lora_bt: Tensor,
    bias: Tensor | None,
    out: Tensor,
    rows: int,
    cols: int,
    rank: int,
    scaling: float,
) -> None:
    """out = round(out + bias + s h B^T) (rows, out) in place, onto the base product with one rounding."""
    for begin, end in _row_blocks(rows, cols):
        block = out[begin:end]
        term = block.float()  # block itself when float32
        if bias is not None:
            term.add_(bias)
        term.addmm_(h[begin:end], lora_bt, alpha=scaling)
        if term is not block:
            block.copy_(term)


def _grad_out(
    grad: Tensor,
    h: Tensor,
    lora_bt: Tensor,
    dh_part: Tensor,
    db_part: Tensor,
    rows: int,
    cols: int,
    rank: int,
    rows_per_split: int,
    scaling: float,
) -> None:
    """dh = s g B (rows, R) and dB = s g^T h (out, R), into partial 0 of each."""
    dh = _first_partial(dh_part)
    db = _first_partial(db_part)
    b = lora_bt.mT  # (out, R)
    for index, (begin, end) in enumerate(_row_blocks(rows, cols)):
        g = grad[begin:end].float()
        dh[begin:end].addmm_(g, b, beta=0, alpha=scaling)  # beta=0: the uninitialised dh is not read
        db.addmm_(g.mT, h[begin:end], beta=1 if index else 0, alpha=scaling)


def _grad_in(
    x: Tensor,
    dh: Tensor,
    lora_a: Tensor,
    grad_x_lora: Tensor | None,
    da_part: Tensor,
    rows: int,
    cols: int,
    rank: int,
    rows_per_split: int,
    rng: Tensor | None,
    threshold: int,
    keep_scale: float,
) -> None:
    """gx = dropout(dh A) (rows, in) in x's dtype, and dA = dh^T dropout(x) (R, in) into partial 0."""
    da = _first_partial(da_part)
    for begin, end in _row_blocks(rows, cols):
        keep = _keep(rng, begin * cols, x[begin:end], threshold)  # one keep-mask for x and dh A
        da.addmm_(dh[begin:end].mT, _dropped(x[begin:end], keep, keep_scale), beta=0 if begin == 0 else 1)
        if grad_x_lora is not None:  # one rounding
            grad_x_lora[begin:end].copy_(_dropped(torch.mm(dh[begin:end], lora_a), keep, keep_scale))


# each kernel's computation, taking the kernel's arguments in the order of its parameters
KERNELS: dict[str, Callable[..., None]] = {
    "lora_down": _down,
    "lora_up": _up,
    "lora_grad_out": _grad_out,
    "lora_grad_in": _grad_in,
}


class TorchKernels:
    """Runs the LoRA kernels' computations with torch operations.

    ``whole_op`` (the default): the eager op, routed here, runs the reference composition
    (:func:`loragen.reference.lora_linear_reference`, less host work per call) instead of the four
    passes; False keeps it on the passes (loragen's CPU tests run the op's host side through them).
    """

    whole_op: bool = True  # also for subclasses that do not call __init__

    def __init__(self, whole_op: bool = True) -> None:
        self.whole_op = whole_op

    def target_blocks(self, device: torch.device) -> int:
        """One block: the torch path needs no split reductions."""
        return 1

    def launch(
        self, spec: KernelSpec, variant: Variant, grid: Grid, args: Sequence[object], device: torch.device
    ) -> None:
        """Compute what kernel ``spec`` computes for ``args`` (``variant`` and ``grid`` do not matter);
        KeyError for a kernel other than the four LoRA kernels."""
        run = KERNELS.get(spec.name)
        if run is None:
            raise KeyError(f"loragen.cuda.selfcheck: no torch path for kernel {spec.name!r}")
        with torch.no_grad():
            run(*args)


# ---- the check in a child process -----------------------------------------------------------------

DRIVER_LAUNCHER = "loragen.cuda.launch:DriverLauncher"
TIMEOUT_S = 300.0  # imports, CUDA start, five NVRTC compiles and tiny launches: a hung kernel is a failure


def check_in_child(
    variant: Variant, device: torch.device, launcher: str = DRIVER_LAUNCHER, timeout: float = TIMEOUT_S
) -> str | None:
    """:func:`check_variant` of ``variant`` on ``device`` in a child process whose launcher is made by
    calling ``launcher`` (``"module:attribute"``); None when it passed, else the reason (a child that
    crashed, timed out or could not be started included)."""
    index = _keyed(device).index if device.type == "cuda" else -1
    alignment = "aligned" if variant.aligned else "unaligned"
    args = [variant.dtype, str(variant.rank_bucket), alignment, str(index), launcher]
    command = [sys.executable, "-m", "loragen.cuda.selfcheck", *args]
    # the caller's module search path: the child imports what the caller does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return f"crashed: the isolated self-check did not finish in {timeout:.0f} s"
    except OSError as exc:  # no interpreter at sys.executable, a process limit reached, no memory to fork
        return f"not checked: cannot start the isolated self-check's process {command[0]!r}: {exc}"
    for line in reversed(done.stdout.splitlines()):
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and "reason" in answer:
            return None if answer["reason"] is None else str(answer["reason"])
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    tail = lines[-1][:300] if lines else "(no output)"
    return f"crashed: the isolated self-check's process exited with status {done.returncode}: {tail}"


# ---- the checked launcher --------------------------------------------------------------------------

OK = "ok"
# largest |kernel - torch path| relative to the largest |torch path| value, by dtype: summation order,
# rounding of 16-bit outputs and, on tensor cores, A or B^T rounded to the 16-bit dtype
BOUNDS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_TORCH_DTYPES = {name: dtype for dtype, name in kernels.DTYPE_NAMES.items()}
_SEED = 0x0123_4567_89AB_CDEF  # both key words non-zero
_OFFSET = 0x0000_0005_0000_0003  # both counter words non-zero
_P = 0.25


def _shape(variant: Variant) -> tuple[int, int, int, int]:
    """rows, in, out, rank of the check problem: odd rows and rank, partial tiles everywhere."""
    rank = max(1, variant.rank_bucket - 3)
    return (67, 264, 136, rank) if variant.aligned else (67, 263, 133, rank)


def _offset_view(values: Tensor, dtype: torch.dtype, device: torch.device, aligned: bool) -> Tensor:
    """``values`` as a contiguous view 16 bytes (aligned) or one element into its storage."""
    offset = 16 // dtype.itemsize if aligned else 1
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
    plan = kernels.Plan(x, g.shape[1], rank, launcher)
    if plan.variant != variant:  # pragma: no cover - the problem is built for the variant
        raise AssertionError(f"self-check problem has variant {plan.variant.label}, not {variant.label}")
    x2, g2 = plan.prepare(x), plan.prepare(g)
    a32 = plan.prepare(kernels.pad_rank(data["a"], variant))  # as the op passes them: (R, in), (R, out)
    bt32 = plan.prepare(kernels.pad_rank(data["bt"], variant))
    # seed and offset in device memory, as the op passes them; both non-zero so both words are read
    rng = torch.tensor([_SEED, _OFFSET], dtype=torch.int64, device=x.device)
    dropout = (rng, philox.keep_threshold(_P), philox.keep_scale(_P))
    h = kernels.down(plan, x2, a32, dropout)
    h_in = h if given is None else given["h"]
    term = g.clone()  # lora_up adds onto what is there (the base product in the op): any finite values
    kernels.up(plan, h_in, bt32, data["bias"], 0.75, term)
    dh, db = kernels.grad_out(plan, g2, h_in, bt32, 0.75)
    dh_in = dh if given is None else given["dh"]
    gx, da = kernels.grad_in(plan, x2, dh_in, a32, dropout, True)
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
    them with the torch path; None when they agree, else the reason (stage and message). Where
    ``kernels`` has an ``arch(device)`` method, bfloat16 needs sm_80 or newer."""
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
    """``device`` with a CUDA device's index made explicit; others kept as given (``cpu``, ``cpu:0``)."""
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
        self, spec: KernelSpec, variant: Variant, grid: Grid, args: Sequence[object], device: torch.device
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
    docstring. ``kernels`` defaults to :func:`loragen.cuda.launch.default_launcher`."""

    def __init__(
        self,
        kernels: KernelLauncher | None = None,
        torch_path: KernelLauncher | None = None,
        *,
        isolate: bool | None = None,
        child_launcher: str = DRIVER_LAUNCHER,
    ) -> None:
        """``isolate``: check in a child process first (default: on CUDA devices when ``kernels`` is the
        default driver launcher). ``child_launcher`` ("module:callable") makes the child's launcher."""
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
        if self._kernels is None:
            self._kernels = default_launcher()
        return self._kernels

    def outcome(self, variant: Variant, device: torch.device | str) -> str | None:
        """``"ok"``, the reason the variant runs on the torch path, or None when not checked yet
        (``"cuda"``: the current CUDA device)."""
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
        """The launcher that runs ``variant`` on ``device`` now, checking it first when it is new.

        Raises:
            RuntimeError: the variant has not been checked yet and a CUDA graph is being captured.
        """
        mode = switches.cuda_kernels.get()
        if mode == "torch":
            return self.torch_path
        if mode == "trust":
            return self.kernels
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
                if launch.capturing(device):
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
        """Check every LoRA variant (or ``variants``) on ``device`` now; :meth:`outcomes` afterwards."""
        lora_variants = [v for spec, v in kernels.all_variants() if spec is kernels.LORA_DOWN]
        for variant in variants or lora_variants:
            self.route(variant, device)
        return self.outcomes()

    # a KernelLauncher too, for callers that launch without routing first
    def target_blocks(self, device: torch.device) -> int:
        return self.kernels.target_blocks(device)

    def launch(
        self, spec: KernelSpec, variant: Variant, grid: Grid, args: Sequence[object], device: torch.device
    ) -> None:
        self.route(variant, device).launch(spec, variant, grid, args, device)


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
    """The child side of :func:`check_in_child`: ``DTYPE BUCKET aligned|unaligned DEVICE_INDEX
    MODULE:LAUNCHER`` (index -1: the CPU); writes one JSON line ``{"reason": ...}`` to stdout."""
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
