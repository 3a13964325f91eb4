"""Regenerate, or check, the golden files that pin loragen's generated code.

The golden files in tests/golden/ hold what the code generators produce today: rewritten model files
(``loragen rewrite``) and class expansions (``@lora_convert``). tests/source/test_rewrite.py and
tests/source/test_decorator.py compare fresh output with them, so any change to generated code shows up as a
reviewable diff. When a change is intended, regenerate them on purpose and commit the diff:

    python scripts/regen_golden.py            # rewrite the golden files that changed
    python scripts/regen_golden.py --check    # exit 1 and list the stale ones, write nothing

Cases that need transformers are pinned to the version they were generated with (its modeling files
change between releases); with another version they are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
TRANSFORMERS_VERSION = "5.23.0"


@dataclasses.dataclass(frozen=True)
class GoldenCase:
    """One golden file: where it lives and how to produce its content."""

    name: str
    path: Path
    generate: Callable[[], str]
    skip_reason: Callable[[], str | None] = lambda: None


def user_model_config():
    """The config of the user-model cases: a regex target, rank_pattern, dropout."""
    from loragen import LoraConfig

    return LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.05,
        rank_pattern={"fc1": 4},
        target_modules=r"(.*\.)?(q_proj|v_proj|fc1|emb|experts\.\d+)",
    )


def load_user_model() -> ModuleType:
    """tests/golden/user_model.py imported as the module ``user_model`` (the decorator needs its source)."""
    if "user_model" in sys.modules:
        return sys.modules["user_model"]
    spec = importlib.util.spec_from_file_location("user_model", GOLDEN / "user_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["user_model"] = module
    spec.loader.exec_module(module)
    return module


def _transformers_file(name: str) -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models" / name / f"modeling_{name}.py"


def _needs_transformers() -> str | None:
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    if transformers.__version__ != TRANSFORMERS_VERSION:
        return f"generated with transformers {TRANSFORMERS_VERSION}, found {transformers.__version__}"
    return None


def _rewrite_user_model() -> str:
    from loragen import rewrite_source

    path = GOLDEN / "user_model.py"
    result = rewrite_source(path.read_text(encoding="utf-8"), user_model_config(), filename="user_model.py")
    if result.errors:
        raise RuntimeError("; ".join(map(str, result.errors)))
    return result.code


def _rewrite_llama() -> str:
    from loragen import LoraConfig, rewrite_source

    path = _transformers_file("llama")
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    result = rewrite_source(
        path.read_text(encoding="utf-8"),
        config,
        filename="modeling_llama.py",
        package="transformers.models.llama",
    )
    if result.errors:
        raise RuntimeError("; ".join(map(str, result.errors)))
    return result.code


def _expand_user_block() -> str:
    from loragen.source.decorator import expansion_source

    return expansion_source(load_user_model().Block, user_model_config())


def _expand_gpt2_attention() -> str:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    from loragen.source.decorator import expansion_source

    return expansion_source(GPT2Attention)


def cases() -> list[GoldenCase]:
    """Every golden file, in a fixed order."""
    return [
        GoldenCase("rewrite of a user model", GOLDEN / "user_model.rewritten.py", _rewrite_user_model),
        GoldenCase(
            "@lora_convert(config) of user_model.Block",
            GOLDEN / "user_model.Block.expansion.py",
            _expand_user_block,
        ),
        GoldenCase(
            "rewrite of transformers' modeling_llama.py",
            GOLDEN / "modeling_llama.rewritten.py",
            _rewrite_llama,
            _needs_transformers,
        ),
        GoldenCase(
            "@lora_convert of transformers' GPT2Attention",
            GOLDEN / "GPT2Attention.expansion.py",
            _expand_gpt2_attention,
            _needs_transformers,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    """Regenerate the golden files (or, with ``--check``, report the stale ones); returns the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a golden file is stale"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from loragen.atomic import atomic_write_text

    stale = 0
    for case in cases():
        reason = case.skip_reason()
        if reason:
            print(f"skip   {case.path.relative_to(ROOT)} ({reason})")
            continue
        new = case.generate()
        old = case.path.read_text(encoding="utf-8") if case.path.exists() else ""
        if new == old:
            print(f"same   {case.path.relative_to(ROOT)}")
            continue
        stale += 1
        changed = sum(
            1
            for line in difflib.unified_diff(old.splitlines(), new.splitlines(), n=0)
            if line[:1] in "+-" and line[:3] not in ("+++", "---")
        )
        if args.check:
            print(f"stale  {case.path.relative_to(ROOT)} ({changed} lines differ)")
        else:
            atomic_write_text(case.path, new)
            print(f"wrote  {case.path.relative_to(ROOT)} ({changed} lines changed)")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
