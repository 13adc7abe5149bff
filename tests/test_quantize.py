"""Quantization schemes side by side: a recipe asks for Quark FP8, MXFP4 or both; each export
loads back with plain transformers and is scored, and eval.json shows what each scheme costs
in accuracy for the bytes it saves. Built on tiny, on CPU (recipes/tiny_mxfp4.yaml)."""
from __future__ import annotations

import json

import pytest

from conftest import REPO, build_beside, doit
from stages.engine.errors import UserError
from stages.engine.recipe import load
from test_pipeline import artifact, pointer

TINY = (REPO / "recipes" / "tiny.yaml").read_text()
WEIGHTS = "model.safetensors"


@pytest.mark.parametrize("written, schemes", [("fp8", ("fp8",)), ("mxfp4", ("mxfp4",)), ("none", ()),
                                              ("[mxfp4, fp8]", ("mxfp4", "fp8"))])
def test_a_recipe_names_one_scheme_several_or_none(tmp_path, written, schemes):
    path = tmp_path / "r.yaml"
    path.write_text(TINY.replace("  scheme: fp8\n", f"  scheme: {written}\n"))
    assert load(path).quantize.schemes == schemes


@pytest.mark.parametrize("written", ["int4", "[fp8, fp8]", "[]", "[fp8, none]", "[fp8, int4]"])
def test_a_bad_scheme_is_one_line_naming_the_key(tmp_path, written):
    path = tmp_path / "r.yaml"
    text = TINY.replace("  scheme: fp8\n", f"  scheme: {written}\n")
    path.write_text(text)
    line = text.splitlines().index(f"  scheme: {written}") + 1
    with pytest.raises(UserError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}:{line}: quantize.scheme: ")
    assert "give one of fp8, mxfp4, a list of them (each once), or none" in str(e.value)


@pytest.fixture(scope="module")
def both(built, tmp_path_factory):
    """The built project with tiny_mxfp4 (FP8 and MXFP4) built too."""
    project, run = build_beside(built, tmp_path_factory, "tiny_mxfp4")
    assert run.rc == 0, run.out[-3000:]
    assert run.stages_ran("tiny_mxfp4") == {"quantized", "eval", "manifest"}  # the rest is tiny's
    return project


def tensors(path) -> dict:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_each_scheme_is_exported_as_quark_says(both, built):
    quantized = artifact(both, "quantized", "tiny_mxfp4")
    assert sorted(p.name for p in quantized.iterdir()) == ["fp8", "mxfp4", "score.json"]
    configs = {s: json.loads((quantized / s / "config.json").read_text())["quantization_config"]
               for s in ("fp8", "mxfp4")}
    assert {c["quant_method"] for c in configs.values()} == {"quark"}
    fp8, mx = (configs[s]["global_quant_config"] for s in ("fp8", "mxfp4"))
    assert fp8["weight"]["dtype"] == fp8["input_tensors"]["dtype"] == "fp8_e4m3"
    assert (mx["weight"]["dtype"], mx["weight"]["group_size"], mx["weight"]["scale_format"]) == ("fp4", 32, "e8m0")
    assert mx["input_tensors"]["dtype"] == "fp4" and mx["input_tensors"]["is_dynamic"]

    # MXFP4 weights are really packed: two FP4 values a byte, one E8M0 scale byte per 32 values
    weights = tensors(quantized / "mxfp4" / WEIGHTS)
    trained = tensors(artifact(both, "checkpoint", "tiny_mxfp4") / "model" / WEIGHTS)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    out_features, in_features = trained[q_proj].shape
    assert str(weights[q_proj].dtype) == "torch.uint8" and weights[q_proj].shape == (out_features, in_features // 2)
    assert weights[q_proj + "_scale"].shape == (out_features, in_features // 32)

    # FP8 is quantized from the trained model afresh: the same bytes as tiny's FP8-only export
    files = json.loads(quantized.with_suffix(".json").read_text())["files"]
    tiny = json.loads(artifact(built, "quantized").with_suffix(".json").read_text())["files"]
    assert {f: d for f, d in files.items() if f.startswith("fp8/")} == {f: d for f, d in tiny.items() if f.startswith("fp8/")}


def test_each_export_loads_back_and_is_close_to_the_trained_model(both):
    import torch
    from transformers import AutoModelForCausalLM

    quantized = artifact(both, "quantized", "tiny_mxfp4")
    trained = AutoModelForCausalLM.from_pretrained(artifact(both, "checkpoint", "tiny_mxfp4") / "model").eval()
    ids = torch.tensor([[3, 40, 41, 42, 17, 5, 60, 61, 70, 12]])
    with torch.no_grad():
        ref = trained(input_ids=ids).logits
        errors = {s: ((AutoModelForCausalLM.from_pretrained(quantized / s).eval()(input_ids=ids).logits - ref).norm()
                      / ref.norm()).item() for s in ("fp8", "mxfp4")}
    assert 0 < errors["fp8"] < errors["mxfp4"] < 0.3, errors  # 8 bits move the logits less than 4
    score = json.loads((quantized / "score.json").read_text())
    assert set(score["schemes"]) == {"fp8", "mxfp4"}
    for scheme, s in score["schemes"].items():
        assert abs(s["train_loss_quantized"] - score["train_loss_unquantized"]) < 0.1, (scheme, s)
    assert score["schemes"]["fp8"]["logits_relative_error"] < score["schemes"]["mxfp4"]["logits_relative_error"]


def test_eval_reports_every_model_score_and_size(both):
    evaluation = json.loads((artifact(both, "eval", "tiny_mxfp4") / "eval.json").read_text())
    models = {"base": evaluation["base"], "trained": evaluation["trained"], **evaluation["quantized"]}
    assert set(models) == {"base", "trained", "fp8", "mxfp4"}
    for m in models.values():
        assert set(m) == {"exact_match", "perplexity", "size_bytes"}
    quantized = artifact(both, "quantized", "tiny_mxfp4")
    for scheme in ("fp8", "mxfp4"):
        assert models[scheme]["size_bytes"] == (quantized / scheme / WEIGHTS).stat().st_size
        assert evaluation["quantization_cost"][scheme] == {
            m: models[scheme][m] - models["trained"][m] for m in ("exact_match", "perplexity")}
    trained = artifact(both, "checkpoint", "tiny_mxfp4") / "model" / WEIGHTS
    assert models["trained"]["size_bytes"] == trained.stat().st_size
    assert models["mxfp4"]["size_bytes"] < models["fp8"]["size_bytes"] < models["trained"]["size_bytes"]
    assert models["mxfp4"]["perplexity"] < models["base"]["perplexity"]  # still far better than untrained

    show = doit(both, "show:tiny_mxfp4")
    assert show.rc == 0, show.out
    for scheme in ("fp8", "mxfp4"):
        q = models[scheme]
        assert f"quantized {scheme} exact match {q['exact_match']:.3f}, perplexity {q['perplexity']:.2f}, " \
               f"{q['size_bytes']:,} bytes" in show.out


def test_the_manifest_records_each_scheme_and_verifies(both):
    manifest = json.loads((artifact(both, "manifest", "tiny_mxfp4") / "manifest.json").read_text())
    assert manifest["recipe"]["quantize"]["scheme"] == ["fp8", "mxfp4"]
    assert manifest["quantized"]["fp8"]["weights"]["dtype"] == "fp8_e4m3"
    assert manifest["quantized"]["mxfp4"]["weights"] == {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                                          "scale_format": "e8m0", "is_dynamic": False}
    assert manifest["quantized"]["mxfp4"]["excluded"] == ["lm_head"]
    assert manifest["artifacts"]["quantized"]["digest"] == pointer(both, "quantized", "tiny_mxfp4")["digest"]
    assert doit(both, "verify:tiny_mxfp4").rc == 0


def test_no_scheme_builds_no_export_and_eval_scores_the_rest(warm):
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("  scheme: fp8\n", "  scheme: none\n"))
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0, run.out[-3000:]
    assert run.stages_ran() == {"quantized", "eval", "manifest"}
    assert [p.name for p in artifact(warm, "quantized").iterdir()] == ["score.json"]
    evaluation = json.loads((artifact(warm, "eval") / "eval.json").read_text())
    assert "quantized" not in evaluation and evaluation["quantization_cost"] == {}
    assert evaluation["trained"]["size_bytes"] > 0
    assert json.loads((artifact(warm, "manifest") / "manifest.json").read_text())["quantized"] == {}


def test_serve_picks_a_scheme_export_first_listed_by_default(tmp_path):
    from stages.inference.served import served

    manifest = {"recipe": {"quantize": {"scheme": ["mxfp4", "fp8"]}},
                "artifacts": {"quantized": {"files": {"fp8/config.json": "a", "mxfp4/config.json": "b", "score.json": "c"}},
                              "checkpoint": {"files": {}}}}
    path = lambda stage: tmp_path / stage  # noqa: E731
    first = served("r", manifest, "d" * 64, True, path)
    assert (first.model_id, first.weights) == (f"r-{'d' * 12}-mxfp4", tmp_path / "quantized" / "mxfp4")
    assert served("r", manifest, "d" * 64, True, path, "fp8").weights == tmp_path / "quantized" / "fp8"
    with pytest.raises(UserError, match="serve:r: no int4 export: recipes/r.yaml quantizes to mxfp4, fp8; pick one"):
        served("r", manifest, "d" * 64, True, path, "int4")


def test_the_stages_after_training_compute_in_the_plans_mode(tmp_path):
    """numerics.as_planned, which quantized and eval call first, puts the process in training's
    mode: the plan's environment block and deterministic kernels (tests/test_gpu.py shows on a GPU
    what it spares: other bytes when the two are rebuilt alone). In a process of its own, since
    the mode holds for the whole process."""
    import os
    import subprocess
    import sys

    from stages import plan
    from stages.train import settings

    block = {**plan.env_block(REPO, "mi300x"), **settings.rocm_env("ck")}  # the widest a plan writes
    (tmp_path / "plan.json").write_text(json.dumps({"decisions": {"env": block}}))
    code = ("import json, os, sys, torch; from pathlib import Path; from stages.model.numerics import as_planned; "
            "assert not torch.are_deterministic_algorithms_enabled(); as_planned(Path(sys.argv[1])); "
            "print(json.dumps([{k: os.environ[k] for k in json.loads(sys.argv[2])}, "
            "torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark]))")
    env = {k: v for k, v in os.environ.items() if k not in block}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path), json.dumps(sorted(block))], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == [block, True, False]
    assert block["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and block["TORCH_ROCM_FA_PREFER_CK"] == "1"


@pytest.mark.parametrize("written, says", [
    ('{"decisions": {"env": {"LD_PRELOAD": "/tmp/evil.so"}}}', "'LD_PRELOAD', which is not a setting of a profile"),
    ('{"decisions": {"env": {"TORCH_EXTENSIONS_DIR": "/tmp/evil"}}}', "'TORCH_EXTENSIONS_DIR', which is not"),
    ('{"decisions": {"env": {"CUBLAS_WORKSPACE_CONFIG": 4096}}}', "not a string of at most 256 characters"),
    ('{"decisions": {"env": {"CUBLAS_WORKSPACE_CONFIG": "' + "x" * 257 + '"}}}', "at most 256 characters"),
    ('{"decisions": {"env": ["CUBLAS_WORKSPACE_CONFIG"]}}', "decisions.env is not a mapping"),
    ('{"decisions": {}}', "not a plan (no decisions.env)"),
    ("[" * 8000 + "]" * 8000, "not a plan"),
    ("[" * 100_000 + "]" * 100_000, "larger than 16384 bytes"),
    ('{"decisions": {"env": {}}, "pad": "' + "x" * (16 << 10) + '"}', "larger than 16384 bytes"),
])
def test_a_hostile_plan_env_is_refused_before_it_is_applied(tmp_path, written, says):
    """A plan can come from a remote cache: its environment block reaches os.environ only with the
    names ops/hardware.yaml's profiles set, as short strings; anything else is one line naming the
    file, and the process's environment is left as it was."""
    import os

    from stages.model.numerics import as_planned

    (tmp_path / "plan.json").write_text(written)
    before = dict(os.environ)
    with pytest.raises(UserError) as e:
        as_planned(tmp_path)
    assert str(tmp_path / "plan.json") in str(e.value) and says in str(e.value) and "\n" not in str(e.value)
    assert dict(os.environ) == before


def test_a_deeply_nested_plan_is_refused_where_the_recursion_limit_is_raised(tmp_path):
    """web3's py_ecc raises Python's recursion limit to 100,000 on import, and then json's parser
    overflows the C stack before any RecursionError: the deepest plan within the size cap is still a
    one-line refusal, not a crash (in a process of its own, as the limit holds for the whole process)."""
    import subprocess
    import sys

    from stages.model.numerics import PLAN_CAP

    (tmp_path / "plan.json").write_text("[" * (PLAN_CAP // 2) + "]" * (PLAN_CAP // 2))
    code = ("import sys; sys.setrecursionlimit(100_000); from pathlib import Path; "
            "from stages.engine.errors import UserError; from stages.model.numerics import as_planned\n"
            "try:\n    as_planned(Path(sys.argv[1]))\nexcept UserError as e:\n    print(e)")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not a plan (no decisions.env)" in run.stdout
