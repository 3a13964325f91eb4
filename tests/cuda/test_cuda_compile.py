"""loragen.cuda without a GPU: rendering, NVRTC compilation of every kernel variant for sm_80 and sm_90
(no register spills), compile errors, the on-disk kernel cache, and a CPU path that never imports
cuda.bindings.

Compiling all variants takes about a minute of NVRTC time on two cores (compiled ahead, one per core);
the cubins are kept in pytest's cache folder (keyed by source, options, architecture and NVRTC version),
so later runs only recompile what changed. ``pytest --cache-clear`` forces a full rebuild.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loragen.cuda import kernels as kern
from loragen.cuda.build import (
    CompiledKernel,
    KernelCache,
    KernelCompileError,
    KernelRenderError,
    RenderedKernel,
    cache_key,
    parse_ptxas_log,
    render_kernel,
)
from tests.cuda.rendering import precompile, rendered, selected_params

# ---- rendering ----------------------------------------------------------------------------------------

VARIANTS = list(kern.all_variants())


def test_every_variant_renders_to_plain_cuda():
    for spec, variant in VARIANTS:
        kernel = rendered(spec, variant)
        assert "{{" not in kernel.source and "}}" not in kernel.source
        assert (
            f'extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {spec.name}(' in kernel.source
        )
        assert f"constexpr int RANK_BUCKET = {variant.rank_bucket};" in kernel.source
        assert f"constexpr bool ALIGNED = {'true' if variant.aligned else 'false'};" in kernel.source
        assert f"typedef {kern.DTYPES[variant.dtype]} scalar_t;" in kernel.source
        assert kernel.headers[0][0] == "lora_common.cuh" and "philox4x32_10" in kernel.headers[0][1]


@pytest.mark.parametrize("name", sorted(kern.KERNELS))
def test_template_signature_matches_spec(name):
    """The launcher packs arguments from specs; the template's parameter list must agree with it."""
    spec = kern.KERNELS[name]
    source = rendered(spec, kern.Variant("bfloat16", 16, True)).source
    match = re.search(rf"{name}\((.*?)\)\s*\{{", source, re.DOTALL)
    assert match is not None
    params = []
    for declaration in match.group(1).split(","):
        words = declaration.replace("__restrict__", "").replace("*", " * ").split()
        params.append(kern.Param(words[-1], " ".join(words[:-1]).replace(" *", "*")))
    assert tuple(params) == spec.params


GOLDEN = Path(__file__).parent / "lora_grad_in.bfloat16-r16-aligned.cu"


def test_rendered_kernel_matches_golden_file():
    """Pins what a person reads: a template change shows up as a diff of this file.

    Regenerate after an intended change: LORAGEN_REGEN_GOLDEN=1 pytest tests/cuda/test_cuda_compile.py -k golden
    """
    source = rendered(kern.KERNELS["lora_grad_in"], kern.Variant("bfloat16", 16, True)).source
    if os.environ.get("LORAGEN_REGEN_GOLDEN"):
        GOLDEN.write_text(source)
    assert GOLDEN.read_text() == source, f"{GOLDEN.name} is stale; see this test's docstring to regenerate it"


def test_missing_parameter_names_kernel_and_variable():
    params = kern.render_params(kern.KERNELS["lora_down"], kern.Variant("float16", 8, True))
    del params["rows_per_warp"]
    with pytest.raises(
        KernelRenderError,
        match=r"kernel lora_down \(kernels/lora_down\.cu\.j2\): 'rows_per_warp' is undefined",
    ):
        render_kernel("lora_down", params)


def test_unused_or_untyped_parameter_is_an_error():
    params = kern.render_params(kern.KERNELS["lora_up"], kern.Variant("float16", 8, True))
    with pytest.raises(KernelRenderError, match=r"lora_up .* does not use parameter\(s\) tile_n; it uses"):
        render_kernel("lora_up", {**params, "tile_n": 4})
    with pytest.raises(
        KernelRenderError, match=r"parameter warps=4\.0 \(float\); expected a bool, int or str"
    ):
        render_kernel("lora_up", {**params, "warps": 4.0})


def test_rank_buckets():
    assert [kern.rank_bucket(r) for r in (1, 8, 9, 16, 17, 33, 64)] == [8, 8, 16, 16, 32, 64, 64]
    with pytest.raises(
        ValueError, match=r"LoRA rank r=65 is not supported by the CUDA kernels; expected 1 <= r <= 64"
    ):
        kern.rank_bucket(65)
    with pytest.raises(
        ValueError, match=r"dtype 'float64' has no kernels; supported: float32, float16, bfloat16"
    ):
        kern.Variant("float64", 8, True)


# ---- NVRTC ---------------------------------------------------------------------------------------------


def test_compile_without_cache(nvrtc_available):
    from loragen.cuda.build import compile_kernel

    kernel = rendered(kern.KERNELS["lora_grad_in"], kern.Variant("bfloat16", 16, True))
    for arch in kern.ARCHS:
        compiled = compile_kernel(kernel, arch)
        assert compiled.cubin[:4] == b"\x7fELF" and compiled.arch == arch
        assert f"Compiling entry function 'lora_grad_in' for '{arch}'" in compiled.log
        usage = compiled.resources["lora_grad_in"]
        assert 0 < usage.registers <= 255 and not usage.spills


@pytest.fixture(scope="module")
def variant_cubins(request, persistent_cache) -> KernelCache:
    """The persistent cache, holding every selected variant of the test below for every architecture:
    a cold cache compiles them ahead, one NVRTC per core, instead of one by one in the tests."""
    selected = selected_params(request, test_variant_compiles_without_spills, "name", "variant")
    kernels = [rendered(kern.KERNELS[name], variant) for name, variant in selected]
    precompile(persistent_cache, [(kernel, arch) for kernel in kernels for arch in kern.ARCHS])
    return persistent_cache


@pytest.mark.kernels  # ~1 minute of NVRTC on two cores when the cubin cache is cold, seconds when warm
@pytest.mark.parametrize(
    ("name", "variant"), [(s.name, v) for s, v in VARIANTS], ids=lambda x: getattr(x, "label", x)
)
def test_variant_compiles_without_spills(variant_cubins, name, variant):
    spec = kern.KERNELS[name]
    kernel = rendered(spec, variant)
    for arch in kern.ARCHS:
        compiled = variant_cubins.get(kernel, arch)
        usage = compiled.resources[name]
        where = f"{kernel.description} on {arch}"
        assert not usage.spills, f"{where} spills: {usage}"
        assert usage.stack_frame_bytes == 0, f"{where} uses local memory: {usage}"
        assert usage.registers <= 255, where
        assert usage.shared_bytes < 48 * 1024, f"{where} needs the dynamic shared-memory opt-in"


BROKEN_TEMPLATE = """\
#include "lora_common.cuh"
constexpr int R = {{ rank_bucket }};
extern "C" __global__ void broken(float* out) {
    out[threadIdx.x] = undefined_symbol * R;
}
"""


def test_compile_error_carries_kernel_params_and_full_log(nvrtc_available, tmp_path):
    from loragen.cuda.build import compile_kernel

    (tmp_path / "broken.cu.j2").write_text(BROKEN_TEMPLATE)
    kernel = render_kernel("broken", {"rank_bucket": 16}, search_path=tmp_path)
    with pytest.raises(KernelCompileError) as caught:
        compile_kernel(kernel, "sm_90")
    error = caught.value
    message = str(error)
    assert "NVRTC could not compile kernel broken (kernels/broken.cu.j2) for sm_90" in message
    assert "rank_bucket = 16" in message and "--gpu-architecture=sm_90" in message
    assert 'identifier "undefined_symbol" is undefined' in error.log
    assert error.log.strip() in message  # the whole log, not an excerpt
    assert error.kernel is kernel and error.arch == "sm_90"


def test_bad_arch_is_rejected(nvrtc_available):
    from loragen.cuda.build import compile_kernel

    kernel = rendered(kern.KERNELS["lora_up"], kern.Variant("float32", 8, True))
    with pytest.raises(ValueError, match=r"arch='compute_90'; expected e\.g\. 'sm_80' or 'sm_90'"):
        compile_kernel(kernel, "compute_90")


def test_parse_ptxas_log():
    log = textwrap.dedent(
        """\
        ptxas info    : 0 bytes gmem
        ptxas info    : Compiling entry function 'lora_up' for 'sm_90'
        ptxas info    : Function properties for lora_up
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 128 registers, used 0 barriers, 380 bytes cmem[0]
        ptxas info    : Compiling entry function 'spiller' for 'sm_80'
        ptxas info    : Function properties for spiller
        ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
        ptxas info    : Used 255 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]
        """
    )
    found = parse_ptxas_log(log)
    assert found["lora_up"].registers == 128 and not found["lora_up"].spills
    spiller = found["spiller"]
    assert spiller.spills and (spiller.spill_store_bytes, spiller.spill_load_bytes) == (8, 12)
    assert spiller.stack_frame_bytes == 24 and spiller.shared_bytes == 2048


# ---- the kernel cache -----------------------------------------------------------------------------------


class CountingCompiler:
    """Stands in for NVRTC: a fake cubin that depends on the source and the architecture."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, kernel: RenderedKernel, arch: str) -> CompiledKernel:
        self.calls += 1
        log = f"ptxas info    : Compiling entry function '{kernel.name}' for '{arch}'\n"
        return CompiledKernel(kernel.name, arch, f"cubin:{arch}:{hash(kernel.source)}".encode(), log)


@pytest.fixture
def kernel() -> RenderedKernel:
    return rendered(kern.KERNELS["lora_down"], kern.Variant("bfloat16", 16, True))


def entries(folder: Path) -> list[Path]:
    return sorted(folder.iterdir())


def test_cache_compiles_once_per_key_across_processes(tmp_path, kernel):
    compiler = CountingCompiler()
    first = KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5))
    compiled = first.get(kernel, "sm_90")
    assert first.get(kernel, "sm_90") is compiled and compiler.calls == 1  # memory hit
    (entry,) = entries(tmp_path)
    assert entry.name.startswith("lora_down.bfloat16-r16-aligned.sm_90.") and entry.suffix == ".cubin"
    header = json.loads(entry.read_bytes().split(b"\n", 1)[0])
    assert (
        header["nvrtc"] == [13, 5]
        and header["arch"] == "sm_90"
        and header["key"] == first.key(kernel, "sm_90")
    )

    second = KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5))  # a new process, same folder
    again = second.get(kernel, "sm_90")
    assert compiler.calls == 1 and second.compiles == 0
    assert again.cubin == compiled.cubin and again.log == compiled.log


def test_cache_key_includes_arch_and_nvrtc_version(tmp_path, kernel):
    assert cache_key(kernel, "sm_80", (13, 5)) != cache_key(kernel, "sm_90", (13, 5))
    assert cache_key(kernel, "sm_90", (13, 5)) != cache_key(kernel, "sm_90", (13, 4))
    compiler = CountingCompiler()
    KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5)).get(kernel, "sm_80")
    KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5)).get(kernel, "sm_90")
    KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 6)).get(kernel, "sm_90")  # a newer NVRTC
    assert compiler.calls == 3 and len(entries(tmp_path)) == 3


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"garbage",
        lambda data: data[: len(data) - 3],  # truncated cubin: checksum fails
        lambda data: data.replace(b'"key": "', b'"key": "0', 1),  # someone else's entry
        lambda data: b"",
    ],
    ids=["garbage", "truncated", "wrong-key", "empty"],
)
def test_corrupt_entry_is_rebuilt_not_loaded(tmp_path, kernel, damage):
    compiler = CountingCompiler()
    good = KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5)).get(kernel, "sm_90")
    (entry,) = entries(tmp_path)
    entry.write_bytes(damage(entry.read_bytes()))

    rebuilt = KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5)).get(kernel, "sm_90")
    assert compiler.calls == 2 and rebuilt.cubin == good.cubin
    reloaded = KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5))
    assert reloaded.get(kernel, "sm_90").cubin == good.cubin and reloaded.compiles == 0


def test_failed_write_leaves_no_partial_entry(tmp_path, kernel, monkeypatch):
    import loragen.atomic

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loragen.atomic.os, "replace", crash)
    cache = KernelCache(tmp_path / "cubins", compiler=CountingCompiler(), nvrtc=(13, 5))
    with pytest.warns(RuntimeWarning, match=r"cannot write the kernel cache in .*cubins .*No space left"):
        compiled = cache.get(kernel, "sm_90")
    assert compiled.cubin.startswith(b"cubin:")  # still usable, from memory
    assert entries(tmp_path / "cubins") == []  # no temporary file, no half entry
    assert cache.directory is None  # memory-only from now on


def test_existing_entry_survives_a_failed_rewrite(tmp_path, kernel, monkeypatch):
    import loragen.atomic

    compiler = CountingCompiler()
    KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5)).get(kernel, "sm_90")
    (entry,) = entries(tmp_path)
    before = entry.read_bytes()

    def crash(src, dst):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(loragen.atomic.os, "replace", crash)
    cache = KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5))
    with pytest.warns(RuntimeWarning):
        cache._store(entry, cache.key(kernel, "sm_90"), compiler(kernel, "sm_90"))
    assert entries(tmp_path) == [entry] and entry.read_bytes() == before


def test_corrupt_entry_in_a_folder_that_cannot_be_written_is_rebuilt_in_memory(tmp_path, kernel, monkeypatch):
    """A shared, read-only cache holding a bad entry: the entry can be neither deleted nor replaced, so
    the kernel is compiled and kept in memory, and the file is left as it was."""
    import pathlib

    import loragen.cuda.build

    compiler = CountingCompiler()
    KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5)).get(kernel, "sm_90")
    (entry,) = entries(tmp_path)
    entry.write_bytes(b"garbage")

    def denied(*args, **kwargs):  # what a folder without write permission answers (tests run as root)
        raise PermissionError(13, "Permission denied", str(entry))

    monkeypatch.setattr(pathlib.Path, "unlink", denied)
    monkeypatch.setattr(loragen.cuda.build, "atomic_write_bytes", denied)
    cache = KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5))
    with pytest.warns(RuntimeWarning, match=r"cannot write the kernel cache .*Permission denied"):
        compiled = cache.get(kernel, "sm_90")
    assert compiled.cubin.startswith(b"cubin:sm_90:") and compiler.calls == 2
    assert cache.get(kernel, "sm_90") is compiled and cache.compiles == 1  # from memory from now on
    assert entries(tmp_path) == [entry] and entry.read_bytes() == b"garbage"


def test_compile_error_is_not_cached(tmp_path, kernel):
    def failing(k: RenderedKernel, arch: str) -> CompiledKernel:
        raise KernelCompileError(k, arch, ("--std=c++17",), "error: nope", "NVRTC_ERROR_COMPILATION")

    cache = KernelCache(tmp_path, compiler=failing, nvrtc=(13, 5))
    with pytest.raises(KernelCompileError, match=r"(?s)kernel lora_down .* for sm_90.*error: nope"):
        cache.get(kernel, "sm_90")
    assert entries(tmp_path) == []


# ---- the CPU path never touches cuda.bindings ---------------------------------------------------------------
# ``import torch`` itself imports cuda.bindings.runtime (and with it the driver module) when cuda-python is
# installed, so the test blocks every cuda.bindings import and records which file asked for it: torch may,
# loragen's CPU path must not. loragen's driver-side modules must not even be loaded.

CPU_PATH = """
import importlib.abc, sys, traceback

asked = []

class BlockCudaBindings(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cuda.bindings" or name.startswith("cuda.bindings."):
            callers = [f.filename for f in traceback.extract_stack() if "importlib" not in f.filename]
            asked.append((name, callers[-2] if len(callers) > 1 else "?"))
            raise ImportError(f"blocked by the test: {name}")
        return None

sys.meta_path.insert(0, BlockCudaBindings())
import torch
assert not torch.cuda.is_available()
import loragen, loragen.cuda, loragen.ops
from loragen.layers import LoraLinear
layer = LoraLinear(16, 8, r=4, lora_dropout=0.1)
layer.train()
out = layer(torch.randn(5, 16, requires_grad=True))
out.sum().backward()
assert layer.lora_A.grad is not None
assert loragen.cuda.is_available() is False
from_loragen = [(name, caller) for name, caller in asked if "loragen" in caller]
loaded = [m for m in ("loragen.cuda.launch", "loragen.cuda.build", "loragen.cuda.linear_op") if m in sys.modules]
print(from_loragen, loaded)
"""


def test_cpu_path_never_imports_cuda_bindings():
    done = subprocess.run(
        [sys.executable, "-c", CPU_PATH], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[] []"
