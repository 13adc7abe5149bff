"""The recipe schema: what it accepts, and the one line it prints for what it does not."""
from __future__ import annotations

from pathlib import Path

import pytest

from stages.engine import keys
from stages.engine.errors import UserError
from stages.engine.recipe import load

REPO = Path(__file__).resolve().parent.parent
TINY = (REPO / "recipes" / "tiny.yaml").read_text()


def load_text(tmp_path: Path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return load(path)


def error(tmp_path: Path, text: str) -> str:
    with pytest.raises(UserError) as e:
        load_text(tmp_path, text)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_shipped_cpu_recipes_build_offline():
    """The CPU recipes need no hub: a model built from config or one built here (tiny_grpo starts
    from tiny's trained model), and data files in the project (the GPU catalogue's recipes are
    loaded by tests/test_catalogue.py)."""
    for path in (REPO / "recipes").glob("*.yaml"):
        recipe = load(path)
        if recipe.hardware.profile == "cpu":
            assert recipe.model.hub is None and all((REPO / s.path).is_file() or s.path.startswith("data/real/")
                                                    for s in recipe.data.sources), path  # data/real/: linked, never committed


def test_recipe_is_frozen(tmp_path):
    recipe = load_text(tmp_path, TINY)
    with pytest.raises(Exception):
        recipe.train.lr = 1.0


def test_unknown_key_names_file_line_and_path(tmp_path):
    text = TINY.replace("  warmup_steps: 5\n", "  warmup_steps: 5\n  warmup_stesp: 6\n")
    line = text.splitlines().index("  warmup_stesp: 6") + 1
    assert error(tmp_path, text) == f"{tmp_path}/r.yaml:{line}: train.warmup_stesp: Extra inputs are not permitted"


def test_wrong_type_names_the_key(tmp_path):
    message = error(tmp_path, TINY.replace("lr: 0.005", "lr: fast"))
    assert "train.lr: Input should be a valid number" in message


def test_a_sharding_outside_its_choices_names_the_line_and_key(tmp_path):
    """hardware.sharding takes auto or fsdp2 only: anything else, a path included, is refused in one line."""
    text = TINY.replace("  profile: cpu\n", "  profile: cpu\n  sharding: ../../etc\n")
    line = text.splitlines().index("  sharding: ../../etc") + 1
    assert error(tmp_path, text) == f"{tmp_path}/r.yaml:{line}: hardware.sharding: Input should be 'auto' or 'fsdp2'"


def test_yaml_syntax_error_names_the_line(tmp_path):
    text = TINY.replace("  max_length: 256\n", "  max_length: [256\n")
    message = error(tmp_path, text)
    assert "YAML syntax error" in message and "r.yaml:" in message
    line = int(message.split("r.yaml:")[1].split(":")[0])
    assert abs(line - (text.splitlines().index("  max_length: [256") + 1)) <= 2


@pytest.mark.parametrize("gpus, ok", [(1, True), (8, True), (2, False), (4, False)])
def test_mi300x_takes_one_or_eight_gpus(tmp_path, gpus, ok):
    text = TINY.replace("  profile: cpu\n", f"  profile: mi300x\n  gpus: {gpus}\n")
    if ok:
        assert load_text(tmp_path, text).hardware.gpus == gpus
    else:
        assert "hardware" in error(tmp_path, text) and "mi300x" in error(tmp_path, text).lower()


def test_model_needs_exactly_one_source(tmp_path):
    text = TINY.replace("model:\n", "model:\n  path: some/dir\n")
    assert "model" in error(tmp_path, text)


def test_key_slices_ignore_unrelated_sections(tmp_path):
    a = load_text(tmp_path, TINY)
    b = load_text(tmp_path, TINY.replace("max_new_tokens: 12", "max_new_tokens: 10"))
    assert keys.recipe_slice(a, "train") == keys.recipe_slice(b, "train")
    assert keys.key_of({"t": keys.recipe_slice(a, "train")}) == keys.key_of({"t": keys.recipe_slice(b, "train")})
    assert keys.recipe_slice(a, "eval") != keys.recipe_slice(b, "eval")


def test_canonical_json_ignores_key_order():
    assert keys.key_of({"a": 1, "b": [1, 2]}) == keys.key_of({"b": [1, 2], "a": 1})
    assert keys.key_of({"a": 1}) != keys.key_of({"a": 2})
