"""The torch path's dropout: loragen's Philox keep-mask (:mod:`loragen.philox`'s layout) applied to
float32 copies of x-shaped tensors, on any device, bit-identical to the mask the CUDA kernels regenerate.

Seed and offset stay where the op drew them: an int64 tensor ``rng`` of two elements on the tensors'
device, read by the device (as the CUDA kernels read their ``const u64* rng``), never by the host. So the
torch path with dropout queues its work without waiting for the GPU, and runs inside CUDA-graph capture.

On a CUDA device it runs on kernels that torch's jiterator compiles at first use
(:data:`JIT_FUNCTIONS`): :data:`KEEP_BITS_SOURCE` makes each group of 8 elements' keep bits with one
Philox call (made once per masked block, used for x and, in backward, for dh A), :data:`APPLY_SOURCE`
writes ``x * 1/(1-p)`` or 0 in float32 -- the same bytes as the float32 copy of x the products need
anyway --, and :data:`APPLY_PAIR_SOURCE` does that for x and dh A in one kernel. So a training step on
the four passes (:class:`loragen.cuda.torch_kernels.TorchKernels`) takes two kernels in forward and two in
backward, and, once a size was seen, no other tensor: the group numbers are views of a counter kept per
device and stream (:func:`group_numbers`). The eager op's composition (:mod:`loragen.cuda.torch_path`)
runs only the keep-bits kernel, once per step, and looks the bits up in a bool table of each byte's 8 bits
(:func:`group_numbers_and_flags`, kept with the counter) to get x's keep-mask, which autograd keeps. A tensor whose element count
or start is not a multiple of 8 takes :data:`KEEP_SOURCE`, one Philox call per element. jiterator computes
in the inputs' common dtype, so the Philox kernels take only int64 inputs (element or group numbers and
the two rng words), and the apply kernels' float32 lane numbers make their common dtype float32.

Why not one kernel per masked tensor, with the group's Philox call inside the apply: every element would
make its group's call again, 8 times the Philox work. Compiled for sm_90 such an apply is about 115
instructions per element, against 37 for :data:`APPLY_SOURCE` and 16 (129 per group of 8) for the keep
bits; at an H100's issue rate (about 30 T thread-instructions/s) that is about 3.9 ps per element, bound by
instructions, where the two kernels here take about 2.8 to 3.3 ps (the apply bound by its 7 to 8 bytes
per element at 3.35 TB/s): a predicted 1.2 to 1.4 times the forward mask's device time, to save one
launch. It would also need seed and offset passed as float32 bit patterns (jiterator converts every input
to the common dtype, float32 there).

Where the jiterator is unavailable (a CPU tensor, a torch built without it, a compile failure: one
warning), :class:`BlockDropout` runs the vectorised torch formulation of :func:`rng_keep_mask`, about 80
elementwise operations on one counter per 8 elements, all bit-identical to the jiterator kernels and to
:func:`loragen.philox.dropout_keep_mask`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from loragen.cuda import streams

__all__ = [
    "APPLY_PAIR_SOURCE",
    "APPLY_SOURCE",
    "JIT_FUNCTIONS",
    "KEEP_BITS_SOURCE",
    "KEEP_SOURCE",
    "BlockDropout",
    "dropped",
    "group_numbers",
    "group_numbers_and_flags",
    "jit_failed",
    "jit_function",
    "jiterator_status",
    "keep_mask",
    "rng_keep_mask",
    "rng_tensor",
]

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Philox key schedule increments
_ROUNDS = 10
_PER_CALL = 8  # elements per Philox call (loragen.philox.ELEMENTS_PER_CALL)

# Philox4x32-10 of the counter (q, offset) under the key ``seed``, as in kernels/lora_common.cuh.j2,
# leaving the four output words in words[0..3]; pasted into the jiterator sources below, after ``q``,
# ``seed`` and ``offset`` (int64 holding the unsigned 64-bit values) are defined.
_PHILOX_CALL = r"""
    const unsigned long long key = static_cast<unsigned long long>(seed);
    const unsigned long long off = static_cast<unsigned long long>(offset);
    unsigned c0 = static_cast<unsigned>(q), c1 = static_cast<unsigned>(q >> 32);
    unsigned c2 = static_cast<unsigned>(off), c3 = static_cast<unsigned>(off >> 32);
    unsigned k0 = static_cast<unsigned>(key), k1 = static_cast<unsigned>(key >> 32);
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    const unsigned words[4] = {c0, c1, c2, c3};
"""

# One thread per group of 8 elements: the group's 8 keep bits. T is int64: the group numbers and the two
# rng words (seed, offset) read from device memory.
KEEP_BITS_SOURCE = (
    r"""template <typename T>
T loragen_keep_bits(T group, T seed, T offset, long long first_group, long long threshold) {
    const unsigned long long q = static_cast<unsigned long long>(first_group + group);"""
    + _PHILOX_CALL
    + r"""    unsigned bits = 0;
    for (int lane = 0; lane < 8; ++lane) {
        const long long u = (words[lane >> 1] >> (16 * (lane & 1))) & 0xFFFFu;
        bits |= static_cast<unsigned>(u >= threshold) << lane;
    }
    return static_cast<T>(bits);
}
"""
)

# One thread per element, its own Philox call: 1 for a kept element, 0 for a dropped one (int64).
KEEP_SOURCE = (
    r"""template <typename T>
T loragen_keep(T element, T seed, T offset, long long start, long long threshold) {
    const unsigned long long i = static_cast<unsigned long long>(start + element);
    const unsigned long long q = i >> 3;"""
    + _PHILOX_CALL
    + r"""    const unsigned lane = static_cast<unsigned>(i & 7);
    const long long u = (words[lane >> 1] >> (16 * (lane & 1))) & 0xFFFFu;
    return static_cast<T>(u >= threshold);
}
"""
)

# One thread per element: bit ``lane`` of ``bits`` (broadcast over the group's 8 lanes, or the element's
# own keep flag with lane 0) picks value * keep_scale or 0. T is float32.
APPLY_SOURCE = r"""template <typename T>
T loragen_apply_keep(T value, T bits, T lane, T keep_scale) {
    return (static_cast<unsigned>(bits) >> static_cast<unsigned>(lane)) & 1u ? value * keep_scale : T(0);
}
"""

# One thread per element pair: ``first`` and ``second`` (x and dh A of one backward block) under the same
# keep bit, in one kernel -- one launch fewer per backward than applying the bits to each. T is float32.
APPLY_PAIR_SOURCE = r"""template <typename T>
void loragen_apply_keep_pair(T first, T second, T bits, T lane, T keep_scale, T& first_out, T& second_out) {
    const bool kept = (static_cast<unsigned>(bits) >> static_cast<unsigned>(lane)) & 1u;
    first_out = kept ? first * keep_scale : T(0);
    second_out = kept ? second * keep_scale : T(0);
}
"""

# each jiterator function: its source, its keyword arguments in the order of the C++ parameters after the
# tensor inputs (torch passes them in this order), and how many outputs it returns by reference (0: one
# output, returned by value)
JIT_FUNCTIONS: dict[str, tuple[str, dict[str, int | float], int]] = {
    "keep_bits": (KEEP_BITS_SOURCE, {"first_group": 0, "threshold": 0}, 0),
    "keep": (KEEP_SOURCE, {"start": 0, "threshold": 0}, 0),
    "apply": (APPLY_SOURCE, {"keep_scale": 1.0}, 0),
    "apply_pair": (APPLY_PAIR_SOURCE, {"keep_scale": 1.0}, 2),
}

# device types whose tensors take the jiterator kernels (loragen's host-work benchmark adds "cpu" with
# stand-in functions that run nothing, to count this path's host work without a GPU)
JIT_DEVICE_TYPES: frozenset[str] = frozenset({"cuda"})

_jit_lock = threading.Lock()
_jit_functions: dict[str, Callable[..., Tensor]] = {}
_jit_failure: list[str] = []  # the first failure, once there was one


def jiterator_status() -> str:
    """``"unused"`` before the first CUDA dropout, ``"ok"`` once the jiterator kernels ran, else why the
    torch formulation is used instead."""
    if _jit_failure:
        return _jit_failure[0]
    return "ok" if _jit_functions else "unused"


def jit_function(name: str) -> Callable[..., Tensor] | None:
    """The jiterator function ``name`` of :data:`JIT_FUNCTIONS` (created once), or None after a failure."""
    found = _jit_functions.get(name)  # the common case: no lock
    if found is not None:
        return found
    with _jit_lock:
        if _jit_failure:
            return None
        if name not in _jit_functions:
            from torch.cuda import jiterator

            source, kwargs, outputs = JIT_FUNCTIONS[name]
            if outputs:
                _jit_functions[name] = jiterator._create_multi_output_jit_fn(source, outputs, **kwargs)
            else:
                _jit_functions[name] = jiterator._create_jit_fn(source, **kwargs)
        return _jit_functions[name]


def jit_failed(exc: BaseException) -> None:
    text = str(exc).strip()
    with _jit_lock:
        if _jit_failure:
            return
        _jit_failure.append(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")
        _jit_functions.clear()
    warnings.warn(
        "loragen.cuda: the jiterator dropout kernels of the torch path (torch.cuda.jiterator) are unavailable "
        f"({_jit_failure[0]}); the mask is built from torch operations instead (same bits, slower)",
        RuntimeWarning,
        stacklevel=4,
    )


def rng_tensor(seed: int, offset: int, device: torch.device) -> Tensor:
    """The int64 (2,) tensor holding unsigned 64-bit ``seed`` and ``offset`` as int64 bits, on ``device``.

    Made with two fills (the values travel as kernel arguments): no host-to-device copy, so no wait for
    the device and nothing a CUDA-graph capture refuses. The caller checks the ranges.
    """
    words = [value - (1 << 64) if value >= 1 << 63 else value for value in (seed, offset)]
    rng = torch.full((2,), words[1], dtype=torch.int64, device=device)
    rng[0].fill_(words[0])
    return rng


def _philox_words(first: int, count: int, rng: Tensor) -> Tensor:
    """Philox4x32-10 of the counters (q, offset) for groups q = first .. first + count - 1 under key
    seed, (seed, offset) = ``rng`` (int64 (2,) on the device): int64 (4, count), words c0..c3 in [0, 2**32).

    The four words are carried as two (2, count) tensors so each round is six whole-tensor operations:
    E = (c0, c2), the words that are multiplied, and O = (c1, c3), their xor partners. A round makes
    E' = hi(flip(E * M)) ^ O ^ K and O' = lo(flip(E * M)) with M = (M0, M1) and K = the round's key words:
    c0' = hi(M1 c2) ^ c1 ^ k0, c2' = hi(M0 c0) ^ c3 ^ k1, c1' = lo(M1 c2), c3' = lo(M0 c0). A uint32
    product is taken as an int64 product, which wraps modulo 2**64 with the same low 64 bits as the
    unsigned product; its high word is ``(p >> 32) & 0xFFFFFFFF`` and its low word is left in O unmasked
    until it is used. Every constant is made on the device from ``arange`` (no host-to-device copy).
    """
    device = rng.device

    def pair(first: int, second: int) -> Tensor:  # int64 (2, 1) [first, second], made on the device
        return torch.arange(
            first, second + (1 if second > first else -1), second - first, device=device
        ).view(2, 1)

    halves = (rng.view(2, 1, 1) >> pair(0, 32)) & _MASK32  # (2, 2, 1): [seed, offset] x [low, high]
    key, offset = halves.unbind(0)  # (2, 1) each: (k0, k1) and (offset low, offset high)
    multipliers, increments = pair(_M0, _M1), pair(_W0, _W1)
    steps = torch.arange(_ROUNDS, dtype=torch.int64, device=device).view(_ROUNDS, 1, 1)
    round_keys = ((key + steps * increments) & _MASK32).unbind(0)  # per round (k0, k1), (2, 1)
    q = torch.arange(first, first + count, dtype=torch.int64, device=device)
    e = torch.stack((q & _MASK32, offset[0].expand(count)))  # (c0, c2)
    o = torch.stack((q >> 32, offset[1].expand(count)))  # (c1, c3)
    for r in range(_ROUNDS):
        product = (e * multipliers).flip(0)  # (M1 c2, M0 c0)
        e = ((product >> 32) ^ o ^ round_keys[r]) & _MASK32
        o = product
    return torch.stack((e, o & _MASK32), dim=1).view(4, count)  # rows c0, c1, c2, c3


def rng_keep_mask(rng: Tensor, start: int, numel: int, threshold: int) -> Tensor:
    """Flat elements ``start .. start + numel - 1`` of the Philox keep-mask (:mod:`loragen.philox`'s
    layout) for (seed, offset) = ``rng`` (int64 (2,), read on its device), as bool on ``rng``'s device;
    ``threshold`` is :func:`loragen.philox.keep_threshold` of p.

    Torch operations only (about 80, on one counter per 8 elements), so it runs on any device.
    """
    if threshold == 0:
        return torch.ones(numel, dtype=torch.bool, device=rng.device)
    first, last = start // _PER_CALL, (start + numel + _PER_CALL - 1) // _PER_CALL
    words = _philox_words(first, last - first, rng)  # (4, G)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # (4, G, 2): lane 2w + h of each group
    keep = (halves >= threshold).permute(1, 0, 2).reshape(-1)  # group-major: element 8q + lane
    skip = start - first * _PER_CALL
    return keep[skip : skip + numel]


def keep_mask(start: int, numel: int, threshold: int, seed: int, offset: int, device: torch.device) -> Tensor:
    """:func:`rng_keep_mask` for seed and offset given as unsigned 64-bit ints; on a CPU tensor it equals
    :func:`loragen.philox.dropout_keep_mask`."""
    return rng_keep_mask(rng_tensor(seed, offset, device), start, numel, threshold)


# ---- group numbers and lane numbers, kept per device and stream -----------------------------------------
# The grouped jiterator kernels read each group's number from an int64 counter 0, 1, 2, ... and each lane's
# number from a float32 (8,) tensor. Both are made once per (device, stream) and grown by doubling, so a
# call takes a cached (groups, 1) view instead of making two aranges. Kept per stream: the arange that
# fills a counter is queued on the stream that first asked for it, and only that stream reads it (another
# stream could read it before it is written). Never freed: a CUDA graph captured with one of them reads its
# memory on every replay, so a counter that grows keeps its old storage alive (less memory than the new
# one). Inside a capture nothing is made for the cache -- a tensor made there holds its values only once
# the graph replays -- so a capture that finds no counter for its stream captures its own aranges.
# Memory: 8 bytes per group of the largest block seen (the torch path's blocks: at most 2**22 groups,
# 32 MiB), and the counters it outgrew, less than that again.
_MIN_GROUPS = 1 << 12  # the smallest counter: 32 KiB
_MAX_VIEWS = 256  # cached (groups, 1) views before the view cache starts over (views only, no memory)


class _Counter:
    """The group counter, lane numbers and keep-flag table of one (device, stream)."""

    __slots__ = ("counter", "flags", "lanes", "retired")

    def __init__(self, counter: Tensor, lanes: Tensor, flags: Tensor) -> None:
        self.counter = counter  # int64 (n,): 0 .. n - 1
        self.lanes = lanes  # float32 (8,): 0 .. 7
        self.flags = flags  # bool (256, 8): row b holds the 8 bits of b
        self.retired: list[Tensor] = []  # counters it outgrew, kept for CUDA graphs that read them


_counters: dict[tuple[torch.device, int], _Counter] = {}
_group_views: dict[tuple[torch.device, int, int], tuple[Tensor, Tensor, Tensor]] = {}
_counter_lock = threading.Lock()


def _lanes(device: torch.device) -> tuple[Tensor, Tensor]:
    """Lane numbers 0 .. 7 (float32) and the keep-flag table (bool (256, 8), row b the bits of b), made on
    ``device``'s current stream."""
    lanes = torch.arange(_PER_CALL, dtype=torch.float32, device=device)
    values = torch.arange(256, device=device).view(256, 1)
    return lanes, values.bitwise_right_shift(lanes.to(torch.int64)).bitwise_and(1).bool()


def group_numbers(device: torch.device, groups: int) -> tuple[Tensor, Tensor]:
    """Group numbers 0 .. ``groups`` - 1 as int64 (groups, 1) and lane numbers 0 .. 7 as float32 (8,), on
    ``device``, for kernels queued on its current stream: views of this (device, stream)'s cached counter
    (no operation at all once a size was seen), or, inside a CUDA-graph capture that finds none, fresh
    tensors made inside the capture."""
    numbers, lanes, _ = group_numbers_and_flags(device, groups)
    return numbers, lanes


def group_numbers_and_flags(device: torch.device, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`group_numbers`, and a bool (256, 8) table whose row b holds the 8 bits of b: a group's keep
    bits (:data:`KEEP_BITS_SOURCE`) looked up in it give the group's 8 keep flags."""
    stream = streams.current_handle(device)
    found = _group_views.get((device, stream, groups))
    if found is not None:
        return found
    captured = streams.capturing(device)
    with _counter_lock:
        entry = _counters.get((device, stream))
        if entry is None or entry.counter.numel() < groups:
            if captured:  # nothing made here is cached: this capture gets its own aranges
                numbers = torch.arange(groups, dtype=torch.int64, device=device).view(groups, 1)
                return (numbers, *_lanes(device))
            size = max(_MIN_GROUPS, 1 << (groups - 1).bit_length())
            counter = torch.arange(size, dtype=torch.int64, device=device)
            if entry is None:
                entry = _counters[(device, stream)] = _Counter(counter, *_lanes(device))
            else:
                entry.retired.append(entry.counter)
                entry.counter = counter
        if len(_group_views) >= _MAX_VIEWS:
            _group_views.clear()
        view = entry.counter[:groups].view(groups, 1)
        found = _group_views[(device, stream, groups)] = view, entry.lanes, entry.flags
    return found


class BlockDropout:
    """The dropout of one block of a masked tensor whose element [0, 0] is flat element ``start``:
    applied to x and, in backward, to the x-shaped product dh A, with one keep-mask between them.

    ``rng`` is the op's int64 (seed, offset) tensor on the block's device; nothing here reads it on the
    host.
    """

    __slots__ = ("_bits", "_keep", "keep_scale", "rng", "start", "threshold")

    def __init__(self, rng: Tensor, start: int, threshold: int, keep_scale: float) -> None:
        self.rng, self.start, self.threshold, self.keep_scale = rng, start, threshold, keep_scale
        self._keep: Tensor | None = None  # bool (rows, cols), the torch formulation
        self._bits: tuple[Tensor, Tensor, bool] | None = None  # jiterator: bits, lanes, grouped

    def __call__(self, values: Tensor) -> Tensor:
        """``values`` (any shape, element [0, ..., 0] being flat element ``start``) in float32, kept
        elements times keep_scale, dropped ones 0; without dropout, ``values`` itself when it is float32
        (callers only read it)."""
        if self.threshold == 0:
            return values.float()
        if (
            self._keep is None
            and values.device.type in JIT_DEVICE_TYPES
            and not _jit_failure
            and values.numel()
        ):
            try:
                out = self._jitted(values)
            except Exception as exc:  # whatever stops the jiterator, the torch formulation gives the same
                jit_failed(exc)
            else:
                if out is not None:
                    return out
        if self._keep is None:
            self._keep = rng_keep_mask(self.rng, self.start, values.numel(), self.threshold).view(
                values.shape
            )
        return torch.where(self._keep, values.float() * self.keep_scale, 0.0)

    def pair(self, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
        """``(self(first), self(second))`` for two tensors of one shape (x and dh A of a backward block):
        on the jiterator path one kernel applies the keep bits to both."""
        if (
            self.threshold
            and self._keep is None
            and first.device.type in JIT_DEVICE_TYPES
            and not _jit_failure
            and first.numel()
        ):
            try:
                out = self._jitted_pair(first, second)
            except Exception as exc:  # whatever stops the jiterator, the torch formulation gives the same
                jit_failed(exc)
            else:
                if out is not None:
                    return out
        return self(first), self(second)

    def _keep_bits(self, values: Tensor) -> tuple[Tensor, Tensor, bool] | None:
        """The keep bits for tensors shaped like ``values``, made by the Philox kernel on first use; None
        after a jiterator failure."""
        if self._bits is not None:
            return self._bits
        numel = values.numel()
        grouped = numel % _PER_CALL == 0 and self.start % _PER_CALL == 0 and values.is_contiguous()
        philox = jit_function("keep_bits" if grouped else "keep")
        if philox is None:
            return None
        device = values.device
        seed, offset = self.rng.unbind()  # views: the kernels read the words on the device
        if grouped:  # one Philox call per 8 elements: (groups, 1) keep bits, broadcast over 8 lanes
            groups, lanes = group_numbers(device, numel // _PER_CALL)
            bits = philox(groups, seed, offset, first_group=self.start // _PER_CALL, threshold=self.threshold)
        else:  # one call per element, its keep flag read as lane 0 (a count or start off 8: rare)
            elements = torch.arange(numel, dtype=torch.int64, device=device).view(values.shape)
            bits = philox(elements, seed, offset, start=self.start, threshold=self.threshold)
            lanes = torch.zeros(1, dtype=torch.float32, device=device)
        self._bits = bits, lanes, grouped
        return self._bits

    def _jitted(self, values: Tensor) -> Tensor | None:
        """The keep bits applied to ``values`` by the apply kernel; None after a jiterator failure."""
        apply = jit_function("apply")
        keep_bits = None if apply is None else self._keep_bits(values)
        if keep_bits is None or apply is None:
            return None
        bits, lanes, grouped = keep_bits
        if not grouped:
            return apply(values, bits, lanes, keep_scale=self.keep_scale)
        if not values.is_contiguous():
            values = values.contiguous()
        return apply(values.view(-1, _PER_CALL), bits, lanes, keep_scale=self.keep_scale).view(values.shape)

    def _jitted_pair(self, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor] | None:
        """The keep bits applied to ``first`` and ``second`` by one kernel; None after a jiterator failure."""
        apply_pair = jit_function("apply_pair")
        keep_bits = None if apply_pair is None else self._keep_bits(first)
        if keep_bits is None or apply_pair is None:
            return None
        bits, lanes, grouped = keep_bits
        if not grouped:
            one, two = apply_pair(first, second, bits, lanes, keep_scale=self.keep_scale)
            return one, two
        shape = first.shape
        if not first.is_contiguous():
            first = first.contiguous()
        if not second.is_contiguous():
            second = second.contiguous()
        one, two = apply_pair(
            first.view(-1, _PER_CALL), second.view(-1, _PER_CALL), bits, lanes, keep_scale=self.keep_scale
        )
        return one.view(shape), two.view(shape)


def dropped(values: Tensor, rng: Tensor, start: int, threshold: int, keep_scale: float) -> Tensor:
    """``values`` (rows, cols) in float32 with dropout applied: kept elements times ``keep_scale``,
    dropped ones 0; ``values[0, 0]`` is flat element ``start`` of the masked tensor (row-major), and
    ``rng`` the int64 (seed, offset) tensor on ``values``' device.

    ``values`` itself when ``threshold`` is 0 and it is float32, else a fresh tensor. The jiterator
    kernels on a CUDA device, the torch formulation of :func:`rng_keep_mask` elsewhere; the same numbers
    either way.
    """
    return BlockDropout(rng, start, threshold, keep_scale)(values)
