"""One home per model family: architecture names live in `engine/model/families/` only, one file per family, and
the model code stays small (files under 400 lines, no function above radon's grade C).

Read from the source tree (nothing is imported but the registry itself, which is torch-free).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ["common", "engine", "serving", "disagg", "prefill", "decode", "router", "transfer", "bench", "launch"]
FAMILIES_DIR = REPO / "engine" / "model" / "families"
# What config.json's `architectures` holds: transformers' class names for a whole model (not its Auto classes)
ARCH_NAME = re.compile(r"\b(?!Auto)[A-Z][A-Za-z0-9]*For(?:CausalLM|ConditionalGeneration)\b")
# Benchmark scripts build tiny checkpoints with transformers' own classes, as the tests do
NOT_PRODUCT = [REPO / "bench" / "scripts"]


def _sources() -> list[Path]:
    out = [REPO / "__init__.py"]
    for folder in FOLDERS:
        out += [p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts
                and not any(place in p.parents for place in NOT_PRODUCT)]
    return out


def test_architecture_names_appear_in_the_registry_only():
    """In code, strings, comments and docstrings alike: a family's name outside its file is a second home."""
    bad = []
    for path in _sources():
        if FAMILIES_DIR in path.parents:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            bad += [f"{path.relative_to(REPO)}:{lineno}: {m}" for m in ARCH_NAME.findall(line)]
    assert not bad, "architecture names outside engine/model/families/:\n" + "\n".join(bad)


def test_the_scan_finds_a_planted_name():
    assert ARCH_NAME.findall('if arch == "MistralForCausalLM" or x in ("Llama4ForConditionalGeneration",):') == \
        ["MistralForCausalLM", "Llama4ForConditionalGeneration"]
    assert not ARCH_NAME.findall("CausalLM, DecoderLayer, MLAAttentionBackend, AutoModelForCausalLM")


def _family_modules() -> list[Path]:
    return sorted(p for p in FAMILIES_DIR.glob("*.py") if p.name != "__init__.py")


def _declared(path: Path) -> list[str]:
    """The architecture names a family file's classes declare (``architecture = "..."``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "architecture"
                                                for t in node.targets):
            names.append(node.value.value)
    return names


def test_every_family_file_registers_what_it_declares():
    """Each file of the package is a family: it declares its architectures and the registry holds exactly
    those, each once."""
    from pd_cluster.engine.model import families

    declared = {name: path.stem for path in _family_modules() for name in _declared(path)}
    assert all(_declared(p) for p in _family_modules()), "a file in families/ that declares no family"
    assert sorted(declared) == families.supported_architectures()
    for name, family in families.REGISTRY.items():
        assert ARCH_NAME.fullmatch(name) and family.architecture == name and family.name


MODEL_CODE = [REPO / "engine" / "model", REPO / "engine" / "layer_attention.py"]


def _model_files() -> list[Path]:
    out = []
    for place in MODEL_CODE:
        out += sorted(place.rglob("*.py")) if place.is_dir() else [place]
    return out


def test_model_files_stay_under_400_lines():
    long = [f"{p.relative_to(REPO)}: {len(p.read_text().splitlines())}" for p in _model_files()
            if len(p.read_text().splitlines()) > 400]
    assert not long, "files over 400 lines:\n" + "\n".join(long)


def test_no_model_function_above_grade_c():
    """radon's cyclomatic complexity: grade C is 11 to 20; D and worse are split up."""
    from radon.complexity import cc_rank, cc_visit

    worse = []
    for path in _model_files():
        for block in cc_visit(path.read_text()):
            if not hasattr(block, "methods") and cc_rank(block.complexity) > "C":  # functions and methods
                worse.append(f"{path.relative_to(REPO)}: {block.fullname} {cc_rank(block.complexity)} "
                             f"({block.complexity})")
    assert not worse, "functions above grade C:\n" + "\n".join(worse)
