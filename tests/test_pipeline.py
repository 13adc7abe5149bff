"""The build system as a user drives it: what ran, what was rebuilt, what the files say."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import ALL_STAGES, doit, snapshot


def pointer(project: Path, stage: str, recipe="tiny") -> dict:
    return json.loads((project / "artifacts" / recipe / f"{stage}.json").read_text())


def artifact(project: Path, stage: str, recipe="tiny") -> Path:
    return project / "artifacts" / "store" / stage / pointer(project, stage, recipe)["key"]


def test_fresh_build_makes_every_artifact(built):
    evaluation = json.loads((artifact(built, "eval") / "eval.json").read_text())
    for model in (evaluation["base"], evaluation["trained"], evaluation["quantized"]["fp8"]):
        assert set(model) == {"exact_match", "perplexity", "size_bytes"}
    assert evaluation["trained"]["perplexity"] < evaluation["base"]["perplexity"]
    steps = [json.loads(l) for l in (artifact(built, "checkpoint") / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)) and len(steps) == 150
    assert steps[-1]["loss"] < steps[0]["loss"]
    quant = json.loads((artifact(built, "quantized") / "fp8" / "config.json").read_text())
    assert "fp8" in json.dumps(quant["quantization_config"]).lower()
    manifest = json.loads((artifact(built, "manifest") / "manifest.json").read_text())
    assert set(manifest["artifacts"]) == ALL_STAGES - {"manifest"}
    for stage, art in manifest["artifacts"].items():
        assert art["digest"] == pointer(built, stage)["digest"]
        assert art["files"]
    assert manifest["versions"]["trl"] and manifest["plan"]["device"] == "cpu"
    for stage in ALL_STAGES:  # a log beside every artifact
        assert artifact(built, stage).with_suffix(".log").read_text().strip()


def test_second_run_runs_nothing_quickly(warm):
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0 and run.ran == [], run.out
    assert run.seconds < 3, run.seconds


def edit_first_training_row(project: Path) -> tuple[str, str]:
    data = project / "data" / "tiny" / "chat.jsonl"
    original = data.read_text()
    heldout = (artifact(project, "shards") / "heldout" / "heldout.jsonl").read_text().splitlines()
    lines = original.splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if json.dumps(json.loads(line), sort_keys=True) not in heldout)
    row = json.loads(lines[i])
    row["messages"][1]["content"] += "!"
    lines[i] = json.dumps(row) + "\n"
    data.write_text("".join(lines))
    return original, "".join(lines)


def test_editing_a_row_rebuilds_from_shards_and_revert_is_cached(warm):
    before = {s: pointer(warm, s) for s in ALL_STAGES}
    original, _ = edit_first_training_row(warm)
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0, run.out[-2000:]
    assert run.stages_ran() == {"shards", "checkpoint", "quantized", "eval", "manifest"}
    (warm / "data" / "tiny" / "chat.jsonl").write_text(original)
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0 and run.ran == [], run.out
    assert {s: pointer(warm, s) for s in ALL_STAGES} == before


def test_changing_eval_settings_reruns_eval_and_manifest_only(warm):
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("max_new_tokens: 12", "max_new_tokens: 10"))
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0, run.out[-2000:]
    assert run.stages_ran() == {"eval", "manifest"}


def test_serving_settings_change_no_artifact_nor_the_receipt(warm):
    recipe = warm / "recipes" / "tiny.yaml"
    assert "\nserve:\n  port: 8000" in recipe.read_text()  # the port README names is in the recipe
    recipe.write_text(recipe.read_text().replace("port: 8000", "port: 8011\n  host: 0.0.0.0"))
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0 and run.ran == [], run.out
    assert doit(warm, "verify:tiny").rc == 0


def test_reformatting_the_recipe_runs_nothing(warm):
    import yaml

    recipe = warm / "recipes" / "tiny.yaml"
    data = yaml.safe_load(recipe.read_text())
    reordered = {k: data[k] for k in reversed(list(data))}
    text = "# reformatted by hand\n" + yaml.safe_dump(reordered, default_flow_style=False, sort_keys=False)
    recipe.write_text(text.replace("path: data/tiny/chat.jsonl", "path: 'data/tiny/chat.jsonl'  # quoted"))
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0 and run.ran == [], run.out


def test_appending_an_exact_duplicate_stops_at_shards(warm):
    train_before = json.loads((warm / "artifacts" / "store" / "shards" /
                               f"{pointer(warm, 'shards')['key']}.json").read_text())["files"]
    data = warm / "data" / "tiny" / "chat.jsonl"
    data.write_text(data.read_text() + data.read_text().splitlines(keepends=True)[3])
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0, run.out[-2000:]
    assert "shards" in run.stages_ran() and "checkpoint" not in run.stages_ran()
    assert run.stages_ran() == {"shards", "manifest"}
    after = artifact(warm, "shards")
    files = json.loads(after.with_suffix(".json").read_text())["files"]
    assert files["train/shard-00000.safetensors"] == train_before["train/shard-00000.safetensors"]
    stats = json.loads((after / "stats.json").read_text())
    assert stats["rows_in_total"] == 3001 and stats["dropped"]["exact_duplicate"] >= 1


def test_verify_passes_then_names_the_flipped_file(warm):
    run = doit(warm, "verify")
    assert run.rc == 0, run.out
    assert doit(warm, "verify:tiny").rc == 0
    for stage in sorted(ALL_STAGES):
        target = sorted(p for p in artifact(warm, stage).rglob("*") if p.is_file())[0]
        raw = bytearray(target.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        target.chmod(0o644)
        target.write_bytes(bytes(raw))
        run = doit(warm, "verify:tiny")
        rel = target.relative_to(artifact(warm, stage)).as_posix()
        assert run.rc != 0
        assert f"verify: tiny: {stage}: {rel} differs" in run.out, run.out
        raw[len(raw) // 2] ^= 0x01
        target.write_bytes(bytes(raw))
    assert doit(warm, "verify").rc == 0


def test_tamper_that_puts_the_mtime_back_is_caught_by_verify_and_the_build(warm):
    import os

    assert doit(warm, "verify:tiny").rc == 0  # the stat cache learns this copy's files
    target = artifact(warm, "checkpoint") / "model" / "model.safetensors"
    good = target.read_bytes()
    st = target.stat()
    target.chmod(0o644)
    with open(target, "r+b") as f:  # same inode, same size, mtime restored (bit rot or cp -p look alike)
        f.seek(len(good) - 1)
        f.write(bytes([good[-1] ^ 0xFF]))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    run = doit(warm, "verify:tiny")
    assert run.rc != 0 and "checkpoint: model/model.safetensors differs" in run.out, run.out
    run = doit(warm, "verify:tiny", "--full")
    assert run.rc != 0 and "checkpoint: model/model.safetensors differs" in run.out
    run = doit(warm, "manifest:tiny")  # the build does not reuse the tampered weights: it retrains
    assert run.rc == 0 and run.stages_ran() == {"checkpoint"}, run.out[-2000:]  # same bytes: cut off there
    assert artifact(warm, "checkpoint").joinpath("model", "model.safetensors").read_bytes() == good
    assert doit(warm, "verify:tiny").rc == 0
    run = doit(warm, "verify", env={"MINDXTRAIN_VERIFY_FULL": "1"})  # every recipe, every byte (README's way)
    assert run.rc == 0 and "verify: tiny: intact (every byte re-read)" in run.out, run.out


def one_error_line(run) -> str:
    lines = [l for l in run.out.splitlines() if l.startswith("error: ")]
    assert run.rc != 0 and len(lines) == 1, run.out[-3000:]
    return lines[0]


def test_bad_input_changes_nothing_and_says_one_line(warm):
    recipe = warm / "recipes" / "tiny.yaml"
    good = recipe.read_text()
    before = snapshot(warm)

    recipe.write_text(good.replace("  max_steps: 150", "  max_steps: 150\n  max_stpes: 151"))
    line = one_error_line(doit(warm, "manifest:tiny"))
    assert "recipes/tiny.yaml:" in line and "train.max_stpes: Extra inputs are not permitted" in line

    recipe.write_text(good.replace("lr: 0.005", "lr: fast"))
    line = one_error_line(doit(warm, "manifest:tiny"))
    assert "recipes/tiny.yaml:" in line and "train.lr: Input should be a valid number" in line

    recipe.write_text(good.replace("data/tiny/chat.jsonl", "data/tiny/missing.jsonl"))
    line = one_error_line(doit(warm, "manifest:tiny"))
    at = good.splitlines().index("    - path: data/tiny/chat.jsonl") + 1
    assert line.startswith(f"error: recipes/tiny.yaml:{at}: data.sources.0.path: data/tiny/missing.jsonl not found; "
                           f"correct the path"), line
    recipe.write_text(good)

    data = warm / "data" / "tiny" / "chat.jsonl"
    lines = data.read_text().splitlines(keepends=True)
    lines[16] = lines[16][:-5] + "\n"
    data.write_text("".join(lines))
    line = one_error_line(doit(warm, "manifest:tiny"))
    assert "data/tiny/chat.jsonl:17: malformed JSON" in line

    assert snapshot(warm) == before


def test_results_are_where_people_look(warm):
    latest = warm / "artifacts" / "tiny" / "latest"
    for stage, name in [("eval", "eval.json"), ("shards", "stats.json"), ("checkpoint", "metrics.jsonl"),
                        ("manifest", "manifest.json"), ("quantized", "score.json")]:
        assert (latest / stage / name).read_bytes() == (artifact(warm, stage) / name).read_bytes()
    run = doit(warm, "show:tiny")
    assert run.rc == 0, run.out
    evaluation = json.loads((latest / "eval" / "eval.json").read_text())
    for name, model in [("base", evaluation["base"]), ("trained", evaluation["trained"]),
                        ("quantized fp8", evaluation["quantized"]["fp8"])]:
        assert f"{name} exact match {model['exact_match']:.3f}, perplexity {model['perplexity']:.2f}, " \
               f"{model['size_bytes']:,} bytes" in run.out
    for stage in ALL_STAGES:
        ptr = pointer(warm, stage)
        assert f"key {ptr['key'][:12]}  digest {ptr['digest'][:12]}  artifacts/tiny/latest/{stage}/" in run.out
    stats = json.loads((latest / "shards" / "stats.json").read_text())
    assert f"dropped: exact_duplicate {stats['dropped']['exact_duplicate']}" in run.out
    score = json.loads((latest / "quantized" / "score.json").read_text())
    assert score["checked_on"]["sequences"] == 8 and "heldout_sequences" not in score
    assert abs(score["schemes"]["fp8"]["train_loss_quantized"] - score["train_loss_unquantized"]) < 0.05  # FP8 barely moves it
    last = json.loads((latest / "checkpoint" / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    assert score["train_loss_unquantized"] < 2 * last  # the training loss it names, not a loss on every token


def test_a_recipe_that_drops_most_rows_warns_before_training(warm):
    recipe = warm / "recipes" / "tiny.yaml"
    short = recipe.read_text().replace("  max_length: 256\n", "  max_length: 38\n").replace("max_steps: 150", "max_steps: 500")
    (warm / "recipes" / "short.yaml").write_text(short)
    run = doit(warm, "check:short")
    assert run.rc == 0, run.out[-3000:]
    warnings = [line for line in run.out.splitlines() if line.startswith("WARNING: ")]
    assert len(warnings) == 2, run.out[-3000:]
    stats = json.loads((artifact(warm, "shards", "short") / "stats.json").read_text())
    dropped = sum(stats["dropped"].values())
    assert f"data: {dropped} of 3000 rows" in warnings[0] and "raise data.max_length (38)" in warnings[0]
    assert f"go over the {stats['sequences']} training sequences" in warnings[1]
    (warm / "recipes" / "short.yaml").write_text(short + "checks:\n  as_errors: true\n")
    run = doit(warm, "manifest:short")
    assert run.rc != 0 and "error: check: data:" in run.out and "checks.as_errors is set" in run.out
    assert "checkpoint" not in run.stages_ran("short")
    assert doit(warm, "check:tiny").out.count("WARNING") == 0  # tiny itself is fine


def test_status_says_what_is_stale_and_why(warm):
    run = doit(warm, "status:tiny")
    assert run.rc == 0 and all(f"  {s:<10} up to date" in run.out for s in ALL_STAGES), run.out
    assert "  report     not built: doit report:tiny\n" in run.out and "never built" not in run.out  # built on request
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("lr: 0.005", "lr: 0.004").replace("max_new_tokens: 12", "max_new_tokens: 10"))
    data = warm / "data" / "tiny" / "chat.jsonl"
    data.write_text(data.read_text() + data.read_text().splitlines(keepends=True)[0])
    out = doit(warm, "status:tiny").out
    assert "  shards     stale: data/tiny/chat.jsonl changed" in out, out
    assert "  checkpoint stale: recipe train.lr (0.005 -> 0.004); and waits on shards" in out
    assert "  quantized  waits on checkpoint, shards: rebuilt only if their bytes change" in out
    assert "  eval       stale: recipe eval.max_new_tokens (12 -> 10); and waits on" in out
    assert "  base       up to date" in out and "  plan       up to date" in out
    assert doit(warm, "manifest:tiny").stages_ran() >= {"shards", "checkpoint", "eval"}


def test_status_is_one_line_a_recipe_and_never_contradicts_itself(warm):
    recipes = sorted(p.stem for p in (warm / "recipes").glob("*.yaml"))
    run = doit(warm, "status")
    lines = run.out.splitlines()
    assert run.rc == 0 and len(lines) == len(recipes) + 1, run.out
    assert [line.split(":")[0] for line in lines[:-1]] == recipes and lines[-1].startswith("doit status:<recipe>")
    assert "tiny: up to date" in lines and "tiny_lora: not built" in lines
    import torch

    gpu_recipe = "gpt_oss_20b: not built"  # hardware.profile h100: on a machine with no GPU, status says so
    assert (gpu_recipe if torch.cuda.is_available() else
            f"{gpu_recipe}; cannot build here: hardware.profile h100 needs a GPU, and none is visible") in lines

    # tiny_lora shares base and shards with tiny: those are up to date for it, and what comes after
    # them is computed from them, not refused for want of tiny_lora's own pointers
    out = doit(warm, "status:tiny_lora").out
    assert "  base       up to date (an earlier build, or another recipe's, in the store: taken as it is)" in out
    assert "  plan       stale: never built" in out and "cannot build yet" not in out, out
    assert "  checkpoint waits on plan\n" in out, out

    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("lr: 0.005", "lr: 0.004"))
    assert "tiny: stale: checkpoint: recipe train.lr (0.005 -> 0.004)" in doit(warm, "status").out.splitlines()
