"""Every bench's --tiny smoke mode, on the CPU. Each runs as a user runs a bench, `python -m
bench.<name> --tiny` from the repository root (no sys.path edits: `stages` is this checkout's),
through the bench's own code and the stages/ functions it measures, and must write the fields
its real run writes (those of its committed results in bench/results/, named below). The
figures are not checked: a smoke run on the CPU measures nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NO_NETWORK, REPO

TIMED = {"tokens_per_s", "peak_gib", "step_seconds", "losses"}  # one train_speed configuration
SETTING = {"attn_implementation", "sdpa_backend", "rocm_fa_library", "gradient_checkpointing", "micro_batch_size",
           "compile", "fused_cross_entropy"}  # a plan's decisions


def bench(name: str, *args, cwd: Path = REPO, check: bool = True) -> str:
    """`python -m bench.<name> *args` in cwd; its output, after checking it exited 0 (check=False:
    that it did not)."""
    p = subprocess.run([sys.executable, "-m", f"bench.{name}", *map(str, args)], cwd=cwd, capture_output=True,
                       text=True, timeout=900, env={**os.environ, **NO_NETWORK})
    assert (p.returncode == 0) == check, (p.stdout + p.stderr)[-4000:]
    return p.stdout + p.stderr


def fields(path: Path) -> dict:
    assert path.is_file(), f"{path}: not written"
    return json.loads(path.read_text())


def test_autotune_probe_searches_on_the_cpu(tmp_path):
    """As autotune_qwen3-8b_lora_2048_gb8_h100_2026-11-26_run1.json: the probe's search, every
    measurement, and the probe's wall time."""
    out = bench("autotune_probe", "--tiny", "--out", tmp_path / "probe.json")
    r = fields(tmp_path / "probe.json")
    assert set(r) == {"shape", "peft", "max_length", "global_batch", "budget_seconds", "flops_per_token",
                      "matmul_peak_tflops", "probe_seconds", "decisions", "tokens_per_s", "measurements"}
    assert set(r["decisions"]) == SETTING and r["shape"] == "tiny" and 0 < r["probe_seconds"] < 60
    assert any("tokens_per_s" in m for m in r["measurements"])
    assert "decisions:" in out


@pytest.fixture(scope="module")
def train_speed(tmp_path_factory) -> Path:
    """One `train_speed --tiny` run: its result, and the work directory compile_precision reads."""
    tmp = tmp_path_factory.mktemp("train_speed")
    bench("train_speed", tmp / "train_speed.json", "--tiny", "--work", tmp / "work")
    return tmp


def test_train_speed_runs_trl_and_ours_with_the_loss_check(train_speed):
    """As train_speed_h200_2026-11-26_real_text_same_host_s1.json, less the TRL configurations that
    need a GPU (flex attention, Liger)."""
    r = fields(train_speed / "train_speed.json")
    assert set(r) == {"shape", "max_length", "batch", "steps", "warmup", "workload", "host", "gpus", "trl_run",
                      "flops_per_token", "matmul_peak_tflops", "best_trl", "ours_decisions", "probe_seconds",
                      "loss_max_abs_diff", "results"}
    assert set(r["results"]) == {"ours", "ours_safe", "trl_default", "trl_packed"}
    assert r["trl_run"] == ["trl_default", "trl_packed"]
    for name, result in r["results"].items():
        assert set(result) == TIMED | {"mfu", "vs_best_trl"} | ({"mfu_work_done"} if name == "ours" else set()), name
    # the tiny chats' prompts have no target: the LM head's FLOPs skipped on them come off ours's MFU
    assert 0 < r["workload"]["completion_tokens"] < r["workload"]["tokens"]
    assert 0 < r["results"]["ours"]["mfu_work_done"] < r["results"]["ours"]["mfu"]
    assert set(r["ours_decisions"]) == SETTING
    assert r["host"]["gpu"] is None and r["host"]["cpu"] and r["host"]["cpus"] >= 1  # --tiny runs on the CPU
    assert set(r["workload"]) == {"rows", "rows_blake3", "tokenizer", "documents", "tokens", "completion_tokens",
                                  "length_median", "length_p90", "at_max_length"}


def test_train_speed_runs_only_the_trl_configurations_named(train_speed, tmp_path):
    """--trl: the short run (ours, ours_safe and the TRL configurations named, the best of those the
    ratio's base); the work directory's finished configurations are kept, as a cut run's are."""
    bench("train_speed", tmp_path / "short.json", "--tiny", "--work", train_speed / "work", "--trl", "trl_default")
    r = fields(tmp_path / "short.json")
    assert set(r["results"]) == {"ours", "ours_safe", "trl_default"} and r["trl_run"] == ["trl_default"]
    assert r["best_trl"] == "trl_default" and r["results"]["trl_default"]["vs_best_trl"] == 1.0
    out = bench("train_speed", tmp_path / "none.json", "--tiny", "--work", train_speed / "work", "--trl", "trl_fast",
                check=False)
    assert "--trl: no TRL configuration trl_fast here" in out and not (tmp_path / "none.json").exists()


def test_compile_precision_trains_compiled_both_ways(train_speed, tmp_path):
    """The runs compile_precision_h200_2026-11-25.json's `runs` hold, on train_speed's tiny result."""
    bench("compile_precision", train_speed / "train_speed.json", tmp_path / "precision.json", "--tiny",
          "--work", tmp_path / "work")
    r = fields(tmp_path / "precision.json")
    assert set(r) == {"result", "decisions", "runs"}
    assert set(r["runs"]) == {"compiled_emulated_casts", "compiled_fused_casts"}
    assert all(set(run) == TIMED for run in r["runs"].values())
    assert r["decisions"]["compile"] is True


def test_step_profile_times_the_step_loop_and_the_trainer(tmp_path):
    """As fp8_base_h100_2026-11-25.json's runs (the step loop; the first two variants add the
    profile's top kernels and host operations) and step_profile_trainer_mb4_h100_2026-11-25.json,
    and the eager step by part as step_profile_breakdown_h100_2026-11-27.json has it."""
    bench("step_profile", "--tiny", "--out", tmp_path / "profile.json")
    r = fields(tmp_path / "profile.json")
    assert set(r) == {"matmul_peak_tflops", "best", "best_amp", "trainer", "breakdown"}
    for name in ("best", "best_amp"):  # the first two variants are profiled in full
        assert set(r[name]) == {"tokens_per_s", "step_seconds", "peak_gib", "losses", "gpu_busy", "gpu_ms_by_kind",
                                "top_kernels", "top_host"}, r[name]
    assert set(r["trainer"]) == {"tokens_per_s", "step_seconds", "peak_gib", "last_loss", "gpu_busy", "gpu_ms_by_kind",
                                 "top_kernels", "gpu_ops", "gaps_ms", "host_late_ms", "queued_ms", "by_thread",
                                 "by_outer", "by_inner"}, r["trainer"]
    parts = r["breakdown"]  # the eager step by part: every part found, the backward's operations included
    # (left unattributed, they would be about half of the step, under "other")
    assert all(parts["seconds"][p] > 0 for p in ("attention", "mlp", "lora", "norms_rope", "loss_head", "optimizer"))
    assert parts["share"]["other"] < 0.1 and abs(sum(parts["share"].values()) - 1) < 0.01
    on_gpu = fields(REPO / "bench" / "results" / "step_profile_breakdown_h100_2026-11-27.json")["breakdown"]
    assert set(parts) == set(on_gpu) and set(parts["seconds"]) == set(on_gpu["seconds"])


def test_kernel_kinds_name_the_step_s_parts_as_a_hopper_profile_names_its_kernels():
    """Kernel names as a compiled step's profile on an H100 had them (step_profile_mb4_compiled_h100_2026-11-27.json)."""
    names = {"nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16": "matmul",
             "triton_tem_fused_add_flex_attention_backward_transpose_view_6": "attention",
             "triton_per_fused_add_flex_attention_backward_transpose_view_5": "attention",
             "triton_poi_fused_add_mul_silu_silu_backward_view_3": "pointwise",
             "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "reduction",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
             "Memset (Device)": "copy_fill", "void at::native::index_elementwise_kernel": "other"}
    # through the bench as a user runs it, from the repository root (bench/ is no installed package)
    code = "import json, sys; from bench.step_profile import kind_of; print(json.dumps([kind_of(n) for n in json.load(sys.stdin)]))"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, input=json.dumps(list(names)), capture_output=True,
                       text=True, timeout=120, env={**os.environ, **NO_NETWORK})
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout) == list(names.values())


def test_gap_split_charges_a_late_launch_to_the_host_and_a_queued_one_to_the_device():
    """Three kernels: the second launched 30 us after the first ended (the GPU waited 30 of the
    40 us gap for the host, inside a compiled layer's call), the third queued long before its
    10 us gap."""

    def op(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    events = [{"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "main"}},
              op("cpu_op", "CompiledFunction", 0, 200), op("cpu_op", "aten::mm", 125, 10),
              op("cuda_runtime", "cudaLaunchKernel", 1, 2, correlation=1),
              op("cuda_runtime", "cudaLaunchKernel", 128, 2, correlation=2),
              op("cuda_runtime", "cudaLaunchKernel", 131, 2, correlation=3),
              op("kernel", "k1", 10, 90, tid=7, correlation=1),      # ends at 100
              op("kernel", "k2", 140, 20, tid=7, correlation=2),     # launched by 130: 30 late, 10 queued
              op("gpu_memset", "Memset", 170, 1, tid=7, correlation=3)]  # 10 queued
    # through the bench as a user runs it, from the repository root (bench/ is no installed package)
    code = "import json, sys; from bench.step_profile import gap_split; print(json.dumps(gap_split(json.load(sys.stdin))))"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, input=json.dumps(events), capture_output=True,
                       text=True, timeout=120, env={**os.environ, **NO_NETWORK})
    assert p.returncode == 0, p.stderr[-2000:]
    r = {k: [tuple(kv) for kv in v] if isinstance(v, list) else v for k, v in json.loads(p.stdout).items()}
    assert (r["gpu_ops"], r["gaps_ms"], r["host_late_ms"], r["queued_ms"]) == (3, 0.05, 0.03, 0.02)
    assert r["by_thread"] == [("main", 0.03)]
    assert r["by_outer"] == [("CompiledFunction", 0.03)] and r["by_inner"] == [("aten::mm", 0.03)]


def test_launch_sources_charge_copies_and_fills_to_the_op_and_frames_that_launched_them():
    """Two copies launched from one place, a fill from another, a matmul (not a copy, left out):
    each copy and fill charged to the innermost op with its shapes and the Python frames
    outside torch around it, innermost first."""

    def op(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    copy = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>"
    events = [op("python_function", "stages/train/sft.py(90): compute_loss", 0, 1000),
              op("python_function", "torch/nn/modules/module.py(1): _call_impl", 5, 900),
              op("python_function", "transformers/loss/loss_utils.py(40): fixed_cross_entropy", 10, 200),
              op("cpu_op", "aten::to", 20, 50, **{"Input Dims": [[8192, 151936]]}),
              op("cpu_op", "aten::copy_", 25, 40),
              op("cuda_runtime", "cudaLaunchKernel", 30, 2, correlation=1),
              op("cuda_runtime", "cudaLaunchKernel", 60, 2, correlation=2),
              op("cpu_op", "aten::zero_", 300, 20, **{"Input Dims": [[16, 4096]]}),
              op("cuda_runtime", "cudaLaunchKernel", 305, 2, correlation=3),
              op("cuda_runtime", "cudaLaunchKernel", 310, 2, correlation=4),
              op("kernel", copy, 100, 600, tid=7, correlation=1),
              op("kernel", copy, 700, 400, tid=7, correlation=2),
              op("gpu_memset", "Memset (Device)", 1100, 3, tid=7, correlation=3),
              op("kernel", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1103, 500, tid=7, correlation=4)]
    code = ("import json, sys; from bench.step_profile import launch_sources; "
            "print(json.dumps(launch_sources(json.load(sys.stdin))))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, input=json.dumps(events), capture_output=True,
                       text=True, timeout=120, env={**os.environ, **NO_NETWORK})
    assert p.returncode == 0, p.stderr[-2000:]
    assert [tuple(r) for r in json.loads(p.stdout)] == [
        (f"{copy[:50]} @ aten::copy_  < transformers/loss/loss_utils.py(40): fixed_cross_entropy"
         " < stages/train/sft.py(90): compute_loss", 1.0, 2),
        ("Memset (Device) @ aten::zero_ [[16, 4096]] < stages/train/sft.py(90): compute_loss", 0.0, 1)]


def test_methods_speed_trains_dpo_and_grpo_both_ways(tmp_path):
    """As methods_speed_h100_2026-11-25.json."""
    bench("methods_speed", tmp_path / "methods.json", "--tiny", "--work", tmp_path / "work")
    r = fields(tmp_path / "methods.json")
    assert set(r) == {"tiny", "global_batch", "results"} and r["tiny"] is True
    assert set(r["results"]) == {"dpo_ours", "dpo_trl", "grpo_ours", "grpo_trl"}
    timed = {"steps_timed", "step_seconds", "step_seconds_each", "tokens_per_s", "samples_per_s", "peak_gib"}
    generation = {"generate_seconds_per_step", "generate_tokens_per_s", "train_seconds_per_step"}
    for name, result in r["results"].items():
        want = timed | (generation if name.startswith("grpo") else set()) | ({"found"} if "ours" in name else set())
        assert set(result) == want, (name, result)
        assert len(result["step_seconds_each"]) == result["steps_timed"]
        assert abs(sum(result["step_seconds_each"]) / result["steps_timed"] - result["step_seconds"]) < 0.01
        if "ours" in name:
            assert set(result["found"]) == {"decisions", "probe_seconds"} and set(result["found"]["decisions"]) == SETTING


def test_grpo_curves_trains_tinys_sft_model_both_ways(built, tmp_path):
    """As grpo_curves_tiny_2026-11-28/curves.json, two steps a side (its real run is CPU work too)."""
    bench("grpo_curves", tmp_path / "out", "--steps", 2, cwd=built)
    curves = fields(tmp_path / "out" / "curves.json")
    assert set(curves) == {"ours", "trl"}
    assert all([p["step"] for p in points] == [1, 2] and all(set(p) == {"step", "loss", "reward"} for p in points)
               for points in curves.values())
    assert (tmp_path / "out" / "curves.png").stat().st_size > 0


def test_data_prep_runs_trl_and_the_shards_stage(tmp_path):
    """As data_prep_real_1m_run1.json: TRL's preparation and `doit shards` on a clone, both dedupe modes."""
    bench("data_prep", "--tiny", "--out", tmp_path / "data.json")
    r = fields(tmp_path / "data.json")
    assert set(r) == {"corpus", "rows", "max_length", "procs", "cpus", "trl", "ours", "ours_exact_dedupe_only"}
    assert r["corpus"] == "tiny" and r["rows"] == 3000
    assert set(r["trl"]) == {"seconds", "tokens", "sequences", "wall_seconds", "peak_rss_mib", "rows", "rows_per_s",
                             "tokens_per_s", "vs_trl_rows_per_s"}
    for name in ("ours", "ours_exact_dedupe_only"):
        assert set(r[name]) == {"seconds", "tokens", "sequences", "wall_seconds", "peak_rss_mib", "dropped",
                                "packing_efficiency", "rows_per_s", "tokens_per_s", "vs_trl_rows_per_s"}, name


def test_pipeline_report_reads_a_built_recipe(warm, tmp_path):
    """As pipeline_h100/pipeline_qwen3_8b_shape.json, from tiny's build (the stages `doit manifest`
    builds: not anchor or report, which it does not)."""
    bench("pipeline_report", "--tiny", "--out", tmp_path / "pipeline.json", cwd=warm)
    r = fields(tmp_path / "pipeline.json")
    assert set(r) == {"recipe", "gpu", "gpus", "stage_seconds", "total_minutes", "train", "probe", "gpu_hours", "usd",
                      "usd_per_gpu_hour", "targets"}
    assert list(r["stage_seconds"]) == ["base", "plan", "shards", "checkpoint", "quantized", "eval", "manifest"]
    assert set(r["train"]) == {"steps", "tokens", "train_runtime_s", "tokens_per_s", "model_tflops", "mfu_datasheet",
                               "mfu_measured_peak", "measured_matmul_peak_tflops", "peak_gpu_memory_gib"}


def test_generation_speed_serves_through_the_engine(tmp_path):
    """As generation_speed_h200_2026-11-26_engine_kv1024_run3.json (less the GPU's bandwidth bound):
    the peers (generate one at a time, `transformers serve --continuous-batching`) and the served
    engine, one stream, concurrent clients through the OpenAI client, greedy equality."""
    bench("generation_speed", "--tiny", "--serve-peer", "--out", tmp_path / "gen.json")
    r = fields(tmp_path / "gen.json")
    real = fields(REPO / "bench" / "results" / "generation_speed_h200_2026-11-26_engine_kv1024_run3.json")
    # since 2026-11-28: whether the served forward was compiled, and the clients' processes
    assert set(r) == set(real) | {"compiled", "client_processes"}
    assert r["compiled"] is False  # not on the CPU
    one = next(iter(r["by_new_tokens"].values()))
    real_one = real["by_new_tokens"]["128"]
    assert set(real_one) - set(one) == {"bandwidth_bound_tokens_per_s", "single_stream_share_of_bound"}
    # since 2026-11-28 (evening): each level measured twice on the tiny run, the second as warm
    assert set(one) - set(real_one) == {"single_stream_warm_tokens_per_s"}
    warm = {"warm_tokens_per_s", "warm_rounds_tokens_per_s"}
    for n, level in one["concurrent"].items():
        assert set(level) == set(real_one["concurrent"]["32"]) | {"client_processes"} | warm
        assert level["client_processes"] == int(n)  # each of the few clients in a process of its own
        assert len(level["warm_rounds_tokens_per_s"]) == 1 and level["warm_tokens_per_s"] > 0
    peer = one["peer_transformers_serve"]
    assert set(peer) == set(real_one["peer_transformers_serve"]) | {"single_stream_warm_tokens_per_s"}
    assert all(c["completion_tokens"] > 0 for c in peer["concurrent"].values())  # the peer answered every client
    assert r["greedy_equal"]["identical"] == r["greedy_equal"]["prompts"]  # fp32 on the CPU: token for token


def test_scale_builds_through_doit_and_runs_the_trl_peer(tmp_path):
    """As scale_h200x4_2026-11-26_replicate.json: each run's fields, ours through `doit checkpoint`
    and TRL's peer, LoRA in 1 and 2 processes and full in 2, with the base's build time and hashing
    speed (the fsdp2 side is GPU-only: on the CPU every several-process run is DDP); --tuned plans ours
    with autotune on, under recipes of their own."""
    bench("scale", "--tiny", "--work", tmp_path / "work", "--out", tmp_path / "scale.json")
    r = fields(tmp_path / "scale.json")
    real = fields(REPO / "bench" / "results" / "scale_h200x4_2026-11-26_replicate.json")
    assert set(real) - set(r) == {"note"}
    run = next(x for x in real["runs"] if "error" not in x)
    assert [(x["method"], x["gpus"], x["peer"]) for x in r["runs"]] == [
        ("lora", 1, False), ("lora", 1, True), ("lora", 2, False), ("lora", 2, True), ("full", 2, False), ("full", 2, True)]
    assert all(set(x) == set(run) for x in r["runs"]), r["runs"]
    assert set(r["base"]["tiny_lora"]) == set(real["base"]["8b_lora"])
    # --tuned: ours with the probe on (the CPU's plan here), the peer without gradient checkpointing
    bench("scale", "--tiny", "--tuned", "--workloads", "tiny_lora", "--gpus", "1", "--work", tmp_path / "work",
          "--out", tmp_path / "tuned.json")
    tuned = fields(tmp_path / "tuned.json")
    assert tuned["settings"].startswith("the CPU") and [(x["side"], "error" in x) for x in tuned["runs"]] == [
        ("ours", False), ("peer", False)]
    recipes = sorted(p.name for p in (tmp_path / "work" / "project" / "recipes").glob("*_tuned.yaml"))
    assert recipes == ["scale_tiny_lora_g1_s0_tuned.yaml"]
    assert json.loads((tmp_path / "work" / "project" / "recipes" / recipes[0]).read_text())["autotune"]["enabled"]


def test_eval_speed_runs_hflm_and_its_wide_batches_side_by_side(tmp_path):
    """As eval_speed_h100_2026-11-27_wide.json: both sides on the same requests, each run timed,
    the ratio's min and median, the wide batch's width; fp32 on the CPU: the same answers."""
    bench("eval_speed", "--tiny", "--out", tmp_path / "eval.json")
    r = fields(tmp_path / "eval.json")
    real = fields(REPO / "bench" / "results" / "eval_speed_h100_2026-11-27_wide.json")
    assert set(real) == set(r)
    assert len(r["runs"]) == 2 and all(set(x) == set(real["runs"][0]) for x in r["runs"])
    assert r["same_answers"] == r["requests"] == 12


def test_hash_equal_brings_the_plan_over_and_compares_every_stage(warm, fresh, tmp_path):
    """bench/hash_equal.py with two projects standing for two machines: the first pushes its build
    and keeps only the plan's entry and bytes to carry (with every stage's entry to compare
    against); the second builds with that as its remote, so its plan is fetched, and every stage's
    digest equals the first's (tiny on the CPU is deterministic). A stage whose digests differ is
    reported with the files that differ (here one entry's file digest, altered on the way)."""
    carried = tmp_path / "carried"
    bench("hash_equal", "first", "tiny", "--out", carried, cwd=warm)
    assert [p.parent.name for p in (carried / "remote" / "ac").glob("*/*.json")] == ["plan"]
    assert sum(p.stat().st_size for p in carried.rglob("*") if p.is_file()) < 1 << 20  # what travels is small
    said = bench("hash_equal", "second", "tiny", "--from", carried, "--out", tmp_path / "equal.json", cwd=fresh)
    result = fields(tmp_path / "equal.json")
    assert result["plan_fetched"] and result["all_equal"], said
    assert set(result["stages"]) == {"base", "plan", "shards", "checkpoint", "quantized", "eval", "manifest"}
    assert {"gpu_uuid", "machine_id"} <= set(result["second_machine"])  # lent hosts may share a hostname

    from stages.engine.store import merkle

    first = json.loads((carried / "first.json").read_text())
    key = first["stages"]["checkpoint"]["key"]
    entry_path = carried / "entries" / "checkpoint" / f"{key}.json"
    entry = json.loads(entry_path.read_text())  # as another machine's build of the same key, other bytes
    entry["sidecar"]["files"]["metrics.jsonl"] = "0" * 64
    entry["sidecar"]["digest"] = first["stages"]["checkpoint"]["digest"] = merkle(entry["sidecar"]["files"])
    entry_path.write_text(json.dumps(entry))
    (carried / "first.json").write_text(json.dumps(first))
    bench("hash_equal", "second", "tiny", "--from", carried, "--out", tmp_path / "differs.json", cwd=fresh)
    differs = fields(tmp_path / "differs.json")
    row = differs["stages"]["checkpoint"]
    assert not row["same_digest"] and row["same_key"] and row["files_differing"] == ["metrics.jsonl"]
    assert differs["plan_fetched"]  # found built already (as after a build over several calls): still told

    entry["sidecar"]["files"]["../../outside"] = "0" * 64  # a carried entry is checked as a remote's
    entry_path.write_text(json.dumps(entry))
    p = subprocess.run([sys.executable, "-m", "bench.hash_equal", "second", "tiny", "--from", str(carried), "--out",
                        str(tmp_path / "hostile.json")], cwd=fresh, capture_output=True, text=True)
    assert p.returncode != 0 and "'../../outside' has an empty, . or .. part" in p.stderr, p.stderr[-2000:]
    first["stages"]["checkpoint"]["key"] = "../" + key  # and a name in first.json that leads out of DIR
    (carried / "first.json").write_text(json.dumps(first))
    p = subprocess.run([sys.executable, "-m", "bench.hash_equal", "second", "tiny", "--from", str(carried), "--out",
                        str(tmp_path / "hostile.json")], cwd=fresh, capture_output=True, text=True)
    assert p.returncode != 0 and "is not a stage and key" in p.stderr and not (tmp_path / "hostile.json").exists()
    from stages.engine.remote import ENTRY_CAP

    for text, said in (("[" * 100_000 + "]" * 100_000, "nested deeper"), ("0" * (ENTRY_CAP + 1), "larger than"),
                       ('{"machine": {}, "stages": {"plan": {"key": 1}}}', "not what `first` writes")):
        (carried / "first.json").write_text(text)  # first.json is as hostile as the entries
        p = subprocess.run([sys.executable, "-m", "bench.hash_equal", "second", "tiny", "--from", str(carried),
                            "--out", str(tmp_path / "hostile.json")], cwd=fresh, capture_output=True, text=True)
        assert p.returncode != 0 and said in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert not (tmp_path / "hostile.json").exists()
