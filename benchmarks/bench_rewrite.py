"""Time and peak memory of ``rewrite_source`` (the work of ``loragen rewrite``) on large model files.

The claim under test: rewriting scales linearly with the file's size. The files: transformers' own
``modeling_qwen3_omni_moe.py`` (about 4,300 lines, 195 KB, the largest modeling file it ships) and
generated model files of a chosen size (default 150 KB and 1 MB) made of model classes as
transformers writes them: an attention block with four projections, an MLP, a decoder layer holding
both, docstrings, a forward pass and a helper function each. Every file is rewritten with
``target_modules="all-linear"``.

Each run is a fresh process that imports loragen, reads the file, then measures one
``rewrite_source`` call: CPU time (``time.process_time``, which a loaded machine inflates less than wall
time), wall time, and the peak resident memory of the process (``VmHWM``) with the part the rewrite added
(peak minus the resident memory before the call). Runs are interleaved (file 1, file 2, ..., file 1, ...)
and medians reported, with the CPU time per KB of source: flat from 150 KB to 1 MB when the rewrite scales
linearly. ``rewrite_source`` imports no torch, so the peak is the rewrite's own plus the interpreter's.

    python benchmarks/bench_rewrite.py                       # Qwen3-Omni, 150 KB and 1 MB, 3 rounds
    python benchmarks/bench_rewrite.py --sizes 150000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

_CHILD = """
import json, resource, sys, time
from loragen.config import LoraConfig
from loragen.source.rewriter import module_name_for_path, rewrite_source

def rss(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field)) / 1024

path = sys.argv[1]
code = open(path, encoding="utf-8").read()
config = LoraConfig(target_modules="all-linear")
package = module_name_for_path(path)[1]
before = rss("VmRSS:")
cpu, wall = time.process_time(), time.perf_counter()
result = rewrite_source(code, config, filename=path, package=package)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
peak = rss("VmHWM:")
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "peak_mb": peak, "added_mb": peak - before,
                  "layers": len(result.rewritten), "errors": [str(e) for e in result.errors]}))
"""

_BLOCK = '''

class Block{i}Attention(nn.Module):
    """Multi-headed attention of block {i}: query, key and value projections, rotary embeddings
    applied by the caller, and an output projection back to the hidden size."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        shape = (batch, length, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            weights = weights + attention_mask[:, :, :, : key.shape[-2]]
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        output = torch.matmul(weights, value).transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(output)


class Block{i}MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block{i}DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Block{i}Attention(config, layer_idx)
        self.mlp = Block{i}MLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


def block{i}_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dimensions of the input (as rotary embeddings do)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
'''


def generated_model(size: int) -> str:
    """A model file of about ``size`` bytes: blocks of model classes, and a model holding one of each."""
    parts = ["import torch\nfrom torch import nn\n"]
    count = 0
    while sum(map(len, parts)) < size:
        parts.append(_BLOCK.replace("{i}", str(count)))
        count += 1
    layers = ", ".join(f"Block{i}DecoderLayer(config, {i})" for i in range(count))
    parts.append(
        textwrap.dedent(
            f"""

            class GeneratedModel(nn.Module):
                def __init__(self, config):
                    super().__init__()
                    self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
                    self.layers = nn.ModuleList([{layers}])
                    self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            """
        )
    )
    return "".join(parts)


def qwen3_omni_file() -> Path:
    import transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe as module

    return Path(module.__file__)


def measure(path: Path) -> dict[str, Any]:
    """One ``rewrite_source`` run on ``path`` in a fresh process (started in the file's folder, so that the
    loragen it imports is the one on ``PYTHONPATH`` / installed, not one in the current folder)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True, cwd=path.parent
    )
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", type=int, nargs="*", default=[150_000, 1_000_000], help="generated file sizes"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-qwen", action="store_true", help="skip transformers' Qwen3-Omni file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        files: dict[str, Path] = {}
        if not args.no_qwen:
            files["modeling_qwen3_omni_moe.py"] = qwen3_omni_file()
        for size in args.sizes:
            path = Path(folder) / f"generated_{size}.py"
            path.write_text(generated_model(size), encoding="utf-8")
            files[path.name] = path
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in files}
        for _ in range(args.rounds):
            for name, path in files.items():
                runs[name].append(measure(path))
        print(f"rewrite_source, target_modules='all-linear', median of {args.rounds} fresh processes")
        print(
            f"{'file':32} {'KB':>6} {'lines':>6} {'layers':>6} {'CPU s':>7} {'ms/KB':>6} {'wall s':>7} "
            f"{'peak MB':>8} {'added MB':>8}"
        )
        for name, path in files.items():
            text = path.read_text(encoding="utf-8")
            kb = len(text.encode()) / 1000
            results = runs[name]
            errors = results[0]["errors"]
            if errors:
                print(f"{name}: errors: {errors[:3]}")
            row = {
                key: statistics.median(r[key] for r in results)
                for key in ("cpu_s", "wall_s", "peak_mb", "added_mb")
            }
            print(
                f"{name:32} {kb:6.0f} {text.count(chr(10)):6d} {results[0]['layers']:6d} {row['cpu_s']:7.2f} "
                f"{row['cpu_s'] * 1000 / kb:6.1f} {row['wall_s']:7.2f} {row['peak_mb']:8.0f} {row['added_mb']:8.0f}"
            )


if __name__ == "__main__":
    main()
