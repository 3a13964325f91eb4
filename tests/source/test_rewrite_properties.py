"""Properties of the code generators, checked with hypothesis: a rewrite is idempotent and changes
nothing outside the targeted calls (besides its imports, ``LORA_CONFIG`` and ``loragen_config``), and the
config literals in generated code rebuild the config exactly."""

from __future__ import annotations

import ast
import difflib

from hypothesis import given
from hypothesis import strategies as st

from loragen import LoraConfig, rewrite_source
from loragen.source.codegen import config_literal, py_literal

# ---- rewrite: idempotent, and nothing outside targeted calls changes ----------------------------------

NAMES = ["q_proj", "k_proj", "dense", "fc1", "emb", "conv", "head", "norm"]
CTORS = {
    "nn.Linear": ("(4, 8{kw})", True),
    "torch.nn.Linear": ("(4, 8{kw})", True),
    "Dense": ("(4, 8{kw})", True),
    "nn.Embedding": ("(10, 4{kw})", True),
    "nn.Conv1d": ("(4, 4, 3{kw})", True),
    "Linear": ("({kw0})", False),  # the user's own class
    "nn.LayerNorm": ("(4{kw})", False),
}
STYLES = ["flat", "spaced", "multiline", "trailing-comma", "long", "long-multiline"]
LONG = "config.hidden_size_of_the_model_times_the_expansion_factor"  # lines that grow past the width


def _call_text(ctor: str, style: str, kw: bool) -> str:
    args, _ = CTORS[ctor]
    flat = args.format(kw=", bias=False" if kw and "Linear" in ctor else "", kw0="")
    inner = flat[1:-1]
    if style.startswith("long") and inner:
        inner = LONG + inner[1:]
        if style == "long":
            return f"{ctor}({inner})"
    if style == "spaced":
        return f"{ctor}( {inner} )"
    if style in ("multiline", "long-multiline"):
        return f"{ctor}(\n            {inner}\n        )"
    if style == "trailing-comma" and inner:
        parts = [p.strip() for p in inner.split(",")]
        return f"{ctor}(\n" + "".join(f"            {p},\n" for p in parts) + "        )"
    return f"{ctor}{flat}"


@st.composite
def model_sources(draw):
    fields = draw(
        st.lists(
            st.tuples(
                st.sampled_from(NAMES),
                st.sampled_from(sorted(CTORS)),
                st.sampled_from(STYLES),
                st.booleans(),
                st.booleans(),
            ),
            min_size=1,
            max_size=6,
            unique_by=lambda f: f[0],
        )
    )
    targets = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    lines = [
        "import torch",
        "from torch import nn",
        "from torch.nn import Linear as Dense",
        "",
        "",
        "class Linear(nn.Module):",
        "    pass",
        "",
        "",
        "class M(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
    ]
    spans: list[tuple[int, int, bool]] = []  # (first line, last line, should change), 1-based
    for name, ctor, style, kw, comment in fields:
        text = f"        self.{name} = {_call_text(ctor, style, kw)}" + ("  # note" if comment else "")
        start = len(lines) + 1
        lines.extend(text.split("\n"))
        spans.append((start, len(lines), name in targets and CTORS[ctor][1]))
    lines += ["", "    def forward(self, x):", "        return x  # nn.Linear(1, 2) in a comment", ""]
    return "\n".join(lines), targets, spans


def _normalise(code: str) -> str:
    """The AST with loragen's additions undone: its imports, ``LORA_CONFIG`` and ``loragen_config`` removed,
    LoRA callees back to a marker, LoRA keywords removed."""
    tree = ast.parse(code)

    def added(stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.ImportFrom):
            return (stmt.module or "").startswith("loragen")
        return isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) in (
            "LORA_CONFIG",
            "loragen_config",
        )

    tree.body = [s for s in tree.body if not added(s)]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            node.body = [s for s in node.body if not added(s)]
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            if callee.startswith("Lora") or callee in (
                "nn.Linear",
                "torch.nn.Linear",
                "Dense",
                "nn.Embedding",
                "nn.Conv1d",
            ):
                node.func = ast.Name("LAYER")
                node.keywords = [k for k in node.keywords if k.arg not in ("r", "lora_alpha", "lora_dropout")]
    return ast.dump(tree)


def _without_additions(lines: list[str]) -> list[str]:
    """``lines`` without the blocks a rewrite adds outside calls: the loragen imports and ``LORA_CONFIG``
    (one block after the imports) and ``loragen_config = LORA_CONFIG`` with the blank line after it."""
    start = lines.index("from loragen import LoraConfig") - 1  # the blank line that opens the block
    end = next(i for i, line in enumerate(lines) if line.startswith("LORA_CONFIG = "))
    if lines[end].endswith("("):
        end = lines.index(")", end)
    kept = lines[:start] + lines[end + 1 :]
    attribute = kept.index("    loragen_config = LORA_CONFIG  # added by loragen rewrite")
    assert kept[attribute + 1] == ""
    return kept[:attribute] + kept[attribute + 2 :]


@given(model_sources(), st.integers(1, 16), st.sampled_from([4, 8, 16.0, 0.5]))
def test_rewrite_is_idempotent_and_changes_only_targeted_calls(source, r, alpha):
    code, targets, spans = source
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets)
    first = rewrite_source(code, config, filename="gen.py")
    assert first.ok, [str(e) for e in first.errors]
    second = rewrite_source(first.code, config, filename="gen.py")
    assert second.code == first.code and not second.changed
    assert _normalise(first.code) == _normalise(code)

    expected = [span for span in spans if span[2]]
    assert len(first.rewritten) == len(expected)
    if not expected:
        assert first.code == code and not first.changed
        return
    old_lines, new_lines = code.split("\n"), _without_additions(first.code.split("\n"))
    changed_spans = [(s, e) for s, e, changed in spans if changed]
    touched: set[int] = set()  # 1-based lines of the input that were edited
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
        a=old_lines, b=new_lines, autojunk=False
    ).get_opcodes():
        if tag == "equal":
            continue
        if tag == "insert":
            assert any(s <= i1 < e for s, e in changed_spans), new_lines[j1:j2]  # keywords on their own lines
            touched.add(i1)
        else:
            touched.update(range(i1 + 1, i2 + 1))
    for start, end, changed in spans:
        assert bool(touched & set(range(start, end + 1))) == changed, (start, end, changed)
    assert touched <= {line for s, e in changed_spans for line in range(s, e + 1)}


# ---- literals in generated code -----------------------------------------------------------------------

NAME = st.from_regex(r"[a-z][a-z0-9_]{0,8}(\.[a-z0-9_]{1,6}){0,2}", fullmatch=True)
REGEX = st.sampled_from(
    [r"(.*\.)?(q_proj|v_proj)", r".*\.layers\.\d{1,2}\.mlp", "a\\\\", 'it\'s"quoted"', r"\w+", "plain"]
)
TARGETS = st.one_of(st.none(), REGEX, st.just("all-linear"), st.lists(NAME, min_size=1, max_size=4))


@st.composite
def configs(draw):
    return LoraConfig(
        r=draw(st.integers(1, 512)),
        lora_alpha=draw(st.one_of(st.integers(-64, 512), st.floats(-1e3, 1e3, allow_nan=False))),
        lora_dropout=draw(st.sampled_from([0.0, 0.05, 0.1, 0.5])),
        target_modules=draw(TARGETS),
        exclude_modules=draw(st.one_of(st.none(), st.lists(NAME, min_size=1, max_size=2))),
        modules_to_save=draw(st.one_of(st.none(), st.lists(NAME, min_size=1, max_size=2))),
        bias=draw(st.sampled_from(["none", "all", "lora_only"])),
        use_rslora=draw(st.booleans()),
        init_lora_weights=draw(st.sampled_from([True, False, "gaussian"])),
        rank_pattern=draw(st.dictionaries(st.one_of(NAME, REGEX), st.integers(1, 64), max_size=2)),
        alpha_pattern=draw(st.dictionaries(NAME, st.floats(-1e3, 1e3, allow_nan=False), max_size=2)),
        fan_in_fan_out=draw(st.booleans()),
    )


@given(configs(), st.integers(0, 60))
def test_config_literal_rebuilds_the_config(config: LoraConfig, column: int):
    text = config_literal(config, column=column)
    assert eval(compile(text, "<literal>", "eval"), {"LoraConfig": LoraConfig}) == config
    first_line = text.split("\n")[0]
    assert column + len(first_line) <= 100 or first_line == "LoraConfig("


@given(
    st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(allow_nan=False, allow_infinity=False),
            st.text(),
        ),
        lambda children: st.one_of(
            st.lists(children, max_size=3), st.dictionaries(st.text(max_size=5), children, max_size=3)
        ),
        max_leaves=8,
    )
)
def test_py_literal_is_a_python_literal_of_the_value(value):
    assert ast.literal_eval(py_literal(value)) == value
