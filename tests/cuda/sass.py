"""Read what NVRTC's cubins really contain: SASS from nvdisasm, resources from cuobjdump, occupancy.

The tools come from PyPI (``nvidia-cuda-nvdisasm``, ``nvidia-cuda-cuobjdump``; :func:`tool` finds them
in the installed wheels or on PATH). :func:`analyse` turns one compiled kernel into a
:class:`SassReport`: registers, shared and local bytes, every global/shared/local memory instruction
by width, the bytes of global loads a thread has issued before it first needs one of them, and the
occupancy those resources allow. ``python -m tests.cuda.sass --json FILE`` compiles every kernel
variant for sm_80 and sm_90 and writes the table (the numbers behind BENCHMARKS.md's model).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Per-SM limits: registers, threads, blocks, shared memory a block may use and the SM holds (bytes),
# and the shared memory the system reserves per block.
ARCH_LIMITS: dict[str, dict[str, int]] = {
    "sm_80": {"registers": 65536, "threads": 2048, "blocks": 32, "shared": 167936, "reserved_shared": 1024},
    "sm_90": {"registers": 65536, "threads": 2048, "blocks": 32, "shared": 233472, "reserved_shared": 1024},
}
_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)(?P<args>[^;]*);")
_LABEL = re.compile(r"^(\.L\w+):")
_TARGET = re.compile(r"`\((\.L\w+)\)")
_REG = re.compile(r"(?<![A-Z])R(\d+)\b")
_SPACES = {
    "LDG": "global",
    "STG": "global",
    "LDS": "shared",
    "STS": "shared",
    "LDL": "local",
    "STL": "local",
    "LD": "generic",
    "ST": "generic",
}
_WIDTHS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


def tool(name: str) -> Path | None:
    """``nvdisasm`` or ``cuobjdump`` from the NVIDIA wheels on sys.path, or from PATH; None if absent."""
    roots = {Path(sysconfig.get_paths()["purelib"]), *(Path(p) for p in sys.path if p)}
    for root in roots:
        for candidate in sorted((root / "nvidia").glob(f"*/bin/{name}")):
            return candidate
    found = shutil.which(name)
    return Path(found) if found else None


@dataclass(frozen=True)
class MemoryOp:
    """One SASS memory instruction: ``LDG.E.128`` is a 128-bit global load."""

    space: str  # global, shared, local or generic
    kind: str  # load or store
    bits: int

    @property
    def name(self) -> str:
        return f"{self.space}-{self.kind}-{self.bits}"


def memory_op(opcode: str) -> MemoryOp | None:
    """The memory access an opcode makes, or None for every other instruction."""
    base, *modifiers = opcode.split(".")
    space = _SPACES.get(base)
    if space is None:
        return None
    bits = next((_WIDTHS[m] for m in modifiers if m in _WIDTHS), 32)
    return MemoryOp(space, "load" if base.startswith("LD") else "store", bits)


@dataclass
class SassReport:
    """What one kernel's cubin for one architecture does with registers and memory."""

    function: str
    arch: str
    threads: int
    registers: int
    shared_bytes: int  # static __shared__ of the kernel
    local_bytes: int  # cuobjdump's LOCAL (spills and stack arrays)
    stack_bytes: int
    instructions: int
    memory: dict[str, int] = field(default_factory=dict)  # MemoryOp.name -> count of instructions
    load_bytes_before_use: int = 0  # largest global-load batch a thread issues before a first use
    loop_load_bytes_before_use: int = 0  # the same inside loops (steady state; prologues excluded)
    occupancy: dict[str, object] = field(default_factory=dict)

    def count(self, space: str, kind: str, bits: int | None = None) -> int:
        """Instructions of ``space`` and ``kind`` (and width ``bits`` if given)."""
        total = 0
        for name, n in self.memory.items():
            s, k, b = name.split("-")
            if s == space and k == kind and (bits is None or int(b) == bits):
                total += n
        return total

    def widths(self, space: str, kind: str) -> set[int]:
        """The widths in bits of the ``space`` ``kind`` instructions present."""
        return {int(name.split("-")[2]) for name in self.memory if name.startswith(f"{space}-{kind}-")}


def instructions(sass: str) -> list[tuple[str, str]]:
    """(opcode, operands) of every instruction in nvdisasm's output."""
    return [(m["op"], m["args"]) for line in sass.splitlines() if (m := _LINE.match(line))]


def loops(sass: str) -> list[tuple[int, int]]:
    """(first, last) instruction indices of every loop: a branch back to a label at or before it."""
    labels: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    index = 0
    for line in sass.splitlines():
        if label := _LABEL.match(line):
            labels[label[1]] = index
        elif match := _LINE.match(line):
            if match["op"].startswith("BRA") and (target := _TARGET.search(match["args"])):
                branches.append((index, target[1]))
            index += 1
    return [(labels[t], i) for i, t in branches if t in labels and labels[t] <= i]


def loop_load_bytes_before_use(sass: str) -> int:
    """:func:`load_bytes_before_use` of the steady state: the largest over the loops, each scanned twice
    in a row so that loads issued for the next iteration (before the back branch) count."""
    code = instructions(sass)
    found = [load_bytes_before_use(code[a : b + 1] * 2) for a, b in loops(sass)]
    return max(found, default=load_bytes_before_use(code))


def load_bytes_before_use(code: list[tuple[str, str]]) -> int:
    """A static estimate of the memory-level parallelism of one thread.

    Walks the code in order, adding each global load's bytes to a batch; the first instruction that
    reads a register a load of the batch writes ends it (the warp stalls there). The result is the
    largest batch, in bytes per thread.
    """
    pending: set[int] = set()
    batch = best = 0
    for opcode, args in code:
        op = memory_op(opcode)
        registers = [int(r) for r in _REG.findall(args)]
        is_load = op is not None and op.kind == "load"
        sources = registers[1:] if (is_load or (op is None and registers)) else registers
        if op is None and opcode.split(".")[0] in {"BRA", "EXIT", "RET", "BAR", "CALL"}:
            sources = []
        if pending.intersection(sources):
            best, batch = max(best, batch), 0
            pending.clear()
        if op is not None and op.space == "global" and op.kind == "load" and registers:
            words = max(1, op.bits // 32)
            pending.update(range(registers[0], registers[0] + words))
            batch += op.bits // 8
    return max(best, batch)


def occupancy(arch: str, threads: int, registers: int, shared_bytes: int) -> dict[str, object]:
    """Resident blocks and warps per SM for a kernel's resources, and what limits them."""
    limits = ARCH_LIMITS[arch]
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256  # allocated per warp, 256 at a time
    by = {
        "threads": limits["threads"] // (warps * 32),
        "blocks": limits["blocks"],
        # the register file is split over 4 schedulers; a warp's registers live in one of them
        "registers": 4 * ((limits["registers"] // 4) // regs_per_warp) // warps,
        "shared": limits["shared"] // (shared_bytes + limits["reserved_shared"]),
    }
    blocks = min(by.values())
    limiter = min(by, key=lambda k: (by[k], k != "registers"))
    return {
        "blocks_per_sm": blocks,
        "warps_per_sm": blocks * warps,
        "occupancy": round(blocks * warps * 32 / limits["threads"], 4),
        "limited_by": limiter,
    }


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout


def resource_usage(cubin: Path) -> dict[str, dict[str, int]]:
    """cuobjdump --dump-resource-usage per function: REG, STACK, SHARED, LOCAL, ..."""
    cuobjdump = tool("cuobjdump")
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump (pip install nvidia-cuda-cuobjdump)")
    found: dict[str, dict[str, int]] = {}
    function = None
    for line in _run([str(cuobjdump), "--dump-resource-usage", str(cubin)]).splitlines():
        if match := re.match(r"\s*Function (\S+):", line):
            function = match[1]
        elif function is not None and "REG:" in line:
            found[function] = {k: int(v) for k, v in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}
            function = None
    return found


def analyse(cubin: bytes, function: str, arch: str, threads: int, shared_bytes: int) -> SassReport:
    """Disassemble ``cubin`` and report on ``function`` (launched with ``threads`` per block)."""
    nvdisasm = tool("nvdisasm")
    if nvdisasm is None:
        raise FileNotFoundError("nvdisasm (pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory(prefix="loragen-sass-") as work:
        path = Path(work) / f"{function}.cubin"
        path.write_bytes(cubin)
        sass = _run([str(nvdisasm), "--print-code", str(path)])
        usage = resource_usage(path)[function]
    code = instructions(sass)
    memory = Counter(op.name for opcode, _ in code if (op := memory_op(opcode)) is not None)
    return SassReport(
        function=function,
        arch=arch,
        threads=threads,
        registers=usage["REG"],
        shared_bytes=shared_bytes,
        local_bytes=usage["LOCAL"],
        stack_bytes=usage["STACK"],
        instructions=len(code),
        memory=dict(sorted(memory.items())),
        load_bytes_before_use=load_bytes_before_use(code),
        loop_load_bytes_before_use=loop_load_bytes_before_use(sass),
        occupancy=occupancy(arch, threads, usage["REG"], shared_bytes),
    )


def report_variant(spec, variant, arch: str, cache=None) -> SassReport:  # type: ignore[no-untyped-def]
    """Compile (or fetch from ``cache``) one kernel variant for ``arch`` and analyse it."""
    from loragen.cuda import kernels
    from loragen.cuda.build import compile_kernel, render_kernel

    kernel = render_kernel(spec.name, kernels.render_params(spec, variant))
    compiled = cache.get(kernel, arch) if cache is not None else compile_kernel(kernel, arch)
    shared = compiled.resources[spec.name].shared_bytes
    return analyse(compiled.cubin, spec.name, arch, spec.threads(variant), shared)


def main(argv: list[str] | None = None) -> int:
    """Write (or print) the SASS table of every kernel variant for sm_80 and sm_90."""
    from loragen.cuda import kernels
    from loragen.cuda.build import KernelCache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the table here (default: print it)")
    parser.add_argument("--cache", type=Path, help="a kernel cache folder (cubins reused between runs)")
    parser.add_argument("--arch", action="append", help="default: every one of loragen.cuda.kernels.ARCHS")
    args = parser.parse_args(argv)
    cache = KernelCache(args.cache) if args.cache else None
    rows = []
    for spec, variant in [*kernels.all_variants(), *kernels.optimizer_variants()]:
        for arch in args.arch or kernels.ARCHS:
            report = report_variant(spec, variant, arch, cache)
            rows.append({"kernel": spec.name, "variant": variant.label, **dataclasses.asdict(report)})
    from loragen import resources
    from loragen.cuda.build import nvrtc_version

    names = [*resources.list_kernels(), "lora_common.cuh.j2"]
    digest = hashlib.sha256(repr([resources.read_kernel(n) for n in names]).encode()).hexdigest()
    header = {
        "generated_by": "python -m tests.cuda.sass --json benchmarks/kernel_sass.json",
        "nvrtc": list(nvrtc_version()),
        "templates_sha256": digest[:16],  # of kernels/*.j2: regenerate when it no longer matches
        "limits": ARCH_LIMITS,
    }
    text = json.dumps({**header, "kernels": rows}, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        for row in rows:
            occ = row["occupancy"]
            print(
                f"{row['kernel']:14} {row['variant']:24} {row['arch']} regs={row['registers']:3} "
                f"smem={row['shared_bytes']:5} local={row['local_bytes']} warps/SM={occ['warps_per_sm']:2} "
                f"({occ['limited_by']}) in-flight/thread={row['load_bytes_before_use']}B "
                f"(loops {row['loop_load_bytes_before_use']}B) {row['memory']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
