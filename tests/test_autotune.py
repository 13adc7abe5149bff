"""The autotune probe's choices, on CPU: candidates per device (a ROCm device faked by its
facts), the search over measured settings (here a table of measurements stands in for the
GPU steps that tests/test_gpu.py runs for real), and the settings applied to a real model."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from stages.train import autotune, settings
from stages import plan

GiB = 2**30
CUDA = {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "hip": None, "cuda": "13.0"}
MI300X = {"device": "cuda", "name": "AMD Instinct MI300X", "hip": "6.4.1", "cuda": None}


def names(candidates):
    return [(c["attn_implementation"], c["sdpa_backend"], c["rocm_fa_library"]) for c in candidates]


def test_cuda_candidates_time_each_sdpa_backend_and_flex():
    got = names(autotune.attention_candidates(CUDA))
    assert got[:4] == [("sdpa", "flash_attention", None), ("sdpa", "cudnn_attention", None),
                       ("sdpa", "efficient_attention", None), ("flex_attention", None, None)]


def test_rocm_candidates_choose_between_aotriton_and_ck_flash_attention():
    got = names(autotune.attention_candidates(MI300X))
    assert ("sdpa", "flash_attention", "aotriton") in got and ("sdpa", "flash_attention", "ck") in got
    assert all(backend != "cudnn_attention" for _, backend, _ in got)  # no cuDNN on ROCm
    assert settings.rocm_env("ck") == {"TORCH_ROCM_FA_PREFER_CK": "1"}
    assert settings.rocm_env("aotriton") == {"TORCH_ROCM_FA_PREFER_CK": "0"}
    assert settings.rocm_env(None) == {}


def test_mi300x_env_block_turns_off_tuning_during_training(tmp_path):
    from conftest import REPO

    env = plan.env_block(REPO, "mi300x")
    assert env["PYTORCH_TUNABLEOP_ENABLED"] == "0" and env["TORCHINDUCTOR_MAX_AUTOTUNE"] == "0"
    assert plan.env_block(REPO, "gfx1100")["PYTORCH_TUNABLEOP_ENABLED"] == "0"


RESIDENT = 16 * GiB  # weights and optimizer state of the tables below


def table_measure(speeds: dict, memory: dict, calls: list, compiled_memory: float = 1.0, total: float = 80 * GiB):
    """A device described by a table: eager tokens/s per attention (1.6x compiled), activations of
    one sequence per checkpointing mode (times compiled_memory when compiled) over RESIDENT; past
    `total` it fails as an out-of-memory would."""
    def measure(s):
        calls.append(s)
        key = (s["sdpa_backend"] or s["attn_implementation"], s["rocm_fa_library"])
        if key not in speeds:
            return {"error": "RuntimeError: No available kernel"}
        mode, mb = s["gradient_checkpointing"], s["micro_batch_size"]
        peak = RESIDENT + memory[mode] * mb * (compiled_memory if s["compile"] else 1)
        if peak > total:
            return {"error": "OutOfMemoryError: CUDA out of memory"}
        ckpt = {"off": 1.3, "selective": 1.15, "full": 1.0}[mode]
        speed = speeds[key] * ckpt * (1 + 0.05 * mb) * (1.6 if s["compile"] else 1.0)
        return {"tokens_per_s": speed, "peak_bytes": peak, "resident_bytes": RESIDENT}
    return measure


def shape(s: dict) -> tuple:
    return (s["sdpa_backend"] or s["attn_implementation"], s["gradient_checkpointing"], s["micro_batch_size"],
            s["compile"])


def test_search_on_a_faked_mi300x_compiles_ck_at_the_largest_batch_that_fits():
    """Flex does not run on this device; CK's flash attention is the fastest. The frontier is
    searched once, compiled, with the screened fastest; the other attentions that ran are
    measured compiled at its winner only, and checkpointing is never tried: no checkpointing fits
    micro-batch 4, 8192 tokens, where a larger micro-batch gains less than recomputation costs."""
    calls = []
    speeds = {("flash_attention", "aotriton"): 1000.0, ("flash_attention", "ck"): 1200.0,
              ("efficient_attention", None): 800.0}
    memory = {"off": 30 * GiB, "selective": 18 * GiB, "full": 10 * GiB}
    found = autotune.search(table_measure(speeds, memory, calls, total=192 * GiB),
                            autotune.attention_candidates(MI300X), global_batch=8, example_tokens=2048,
                            deadline=time.monotonic() + 60, total_memory=192 * GiB)
    d = found["decisions"]
    assert (d["sdpa_backend"], d["rocm_fa_library"], d["compile"]) == ("flash_attention", "ck", True)
    assert (d["gradient_checkpointing"], d["micro_batch_size"]) == ("off", 4)  # 8 needs 256 GiB
    measured = [shape(m) for m in found["measurements"]]
    assert ("flex_attention", "off", 8, True) in measured  # flex tried compiled, its error recorded
    assert not any(a == "flex_attention" and not compiled for a, _, _, compiled in measured)
    assert {(a, mb) for a, mode, mb, compiled in measured if compiled and a != "flex_attention"} == \
        {("flash_attention", 8), ("flash_attention", 4), ("efficient_attention", 4)}
    assert not any(mode != "off" for _, mode, _, compiled in measured if compiled)
    assert len(found["measurements"]) == 9  # 3 screened, 1 reference, flex, ck at 8 and 4, 2 others


@pytest.mark.parametrize("total, chosen", [(80 * GiB, 4), (141 * GiB, 8)])
def test_the_memory_floor_spares_compiling_a_micro_batch_that_cannot_fit(total, chosen):
    """The cold H100 case: eager, one sequence holds 16.5 GiB of activations. Micro-batch 8 could
    not fit 90% of 80 GiB even at half of that, so it is never compiled (the search before the
    floor compiled it to an out-of-memory, 15 s); on 141 GiB it may fit, is measured, and wins."""
    calls = []
    found = autotune.search(table_measure({("flash_attention", None): 1000.0}, {"off": 16.5 * GiB, "full": 4 * GiB},
                                          calls, compiled_memory=0.64, total=total),
                            [autotune.attention_candidates(CUDA)[0]], global_batch=8, example_tokens=2048,
                            deadline=time.monotonic() + 60, total_memory=total)
    assert (found["decisions"]["micro_batch_size"], found["decisions"]["compile"]) == (chosen, True)
    compiled = [s["micro_batch_size"] for s in calls if s["compile"]]
    assert compiled == ([4] if chosen == 4 else [8])


@pytest.mark.parametrize("example_tokens, chosen", [(2048, ("selective", 4)), (512, ("full", 8))])
def test_checkpointing_is_tried_only_while_the_lighter_mode_fits_few_tokens(example_tokens, chosen):
    """No checkpointing fits micro-batch 1 only. Then selective checkpointing is tried at larger
    micro-batches (it fits 4), and full checkpointing only while 4 sequences are still under
    SATURATING_TOKENS: with 2048-token sequences they are not, with 512-token ones they are."""
    calls = []
    memory = {"off": 30 * GiB, "selective": 12 * GiB, "full": 5 * GiB}
    found = autotune.search(table_measure({("flash_attention", None): 1000.0}, memory, calls),
                            [autotune.attention_candidates(CUDA)[0]], global_batch=8,
                            example_tokens=example_tokens, deadline=time.monotonic() + 60, total_memory=80 * GiB)
    d = found["decisions"]
    assert (d["gradient_checkpointing"], d["micro_batch_size"], d["compile"]) == (*chosen, True)
    full = [s["micro_batch_size"] for s in calls if s["compile"] and s["gradient_checkpointing"] == "full"]
    assert full == ([8] if example_tokens == 512 else [])
    selective = [s["micro_batch_size"] for s in calls if s["compile"] and s["gradient_checkpointing"] == "selective"]
    assert selective == [8, 4]  # 8 does not fit; nothing at or under the 1 that no checkpointing fit


def test_where_nothing_compiles_the_frontier_is_searched_eagerly():
    calls = []
    table = table_measure({("efficient_attention", None): 1000.0}, {"off": 20 * GiB, "selective": 10 * GiB, "full": 5 * GiB},
                           calls)

    def measure(s):
        return {"error": "BackendCompilerFailed: inductor"} if s["compile"] else table(s)

    found = autotune.search(measure, autotune.attention_candidates(CUDA), global_batch=4, example_tokens=2048,
                            deadline=time.monotonic() + 60, total_memory=80 * GiB)
    d = found["decisions"]
    assert (d["sdpa_backend"], d["compile"], d["gradient_checkpointing"], d["micro_batch_size"]) == \
        ("efficient_attention", False, "off", 2)  # 4 needs 96 GiB


def test_search_keeps_safe_settings_when_the_budget_is_spent():
    calls = []
    speeds = {("flash_attention", None): 1000.0}
    memory = {"off": GiB, "selective": GiB, "full": GiB}
    found = autotune.search(table_measure(speeds, memory, calls), autotune.attention_candidates(CUDA),
                            global_batch=4, example_tokens=2048, deadline=time.monotonic() - 1, total_memory=80 * GiB)
    assert found["decisions"] is None and calls == []  # nothing measured past the deadline


def test_time_up_after_the_screen_keeps_the_fastest_setting_that_ran(monkeypatch):
    """A budget spent on the screen (a slow or busy machine) plans the fastest safe setting
    measured, as the module promises ("keeps the best found so far"), rather than nothing; the
    plan stage would otherwise stop on a machine where training runs."""
    clock = [0.0]
    monkeypatch.setattr(autotune, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    table = table_measure({("flash_attention", None): 1000.0, ("efficient_attention", None): 1200.0},
                          {"off": GiB, "selective": GiB, "full": GiB}, [])

    def measure(s):
        clock[0] += 10  # each measurement takes 10 s of a 25-s budget
        return table(s)

    found = autotune.search(measure, autotune.attention_candidates(CUDA), global_batch=4, example_tokens=2048,
                            deadline=25, total_memory=80 * GiB)
    d = found["decisions"]
    assert [m["compile"] for m in found["measurements"]] == [False] * 3  # the screen, then time was up
    assert (d["sdpa_backend"], d["gradient_checkpointing"], d["micro_batch_size"], d["compile"]) == \
        ("efficient_attention", "full", 1, False)
    assert found["tokens_per_s"] == max(m["tokens_per_s"] for m in found["measurements"] if "error" not in m)


def test_micro_batches_keep_the_global_batch_exact():
    assert autotune.micro_batches(12) == [1, 2, 3, 4, 6, 12]


def tiny_qwen3(vocab_size: int):
    """A two-layer Qwen3: the real architecture, small enough to train and compile on CPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=16))


def sdpa_setting(checkpointing: str = "off", compile: bool = False) -> dict:
    """A setting for apply_settings on CPU: SDPA, no fused loss."""
    return {"attn_implementation": "sdpa", "rocm_fa_library": None, "gradient_checkpointing": checkpointing,
            "compile": compile, "fused_cross_entropy": False}


@pytest.mark.parametrize("mode, recomputed", [("off", 0), ("selective", 1), ("full", 2)])
def test_checkpointing_modes_on_a_real_model(mode, recomputed):
    import torch

    model = tiny_qwen3(vocab_size=64)
    model.train()
    settings.apply_settings(model, sdpa_setting(mode))
    assert sum(layer.gradient_checkpointing for layer in model.model.layers) == recomputed
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()  # trains in every mode
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_compiled_regions_train_as_eager_does_loss_included():
    """compile: the decoder layers and the loss compiled give the eager loss and gradients
    (the loss's label shift, ignored labels and sum-over-items normalization kept)."""
    import torch
    from peft import get_peft_model

    from stages.train.settings import lora_config
    from stages.engine.recipe import TrainSection

    def loss_and_grads(compile: bool):
        torch.manual_seed(0)
        lora = lora_config(TrainSection(peft="lora", lora={"r": 4, "alpha": 8}))
        model = get_peft_model(tiny_qwen3(vocab_size=96), lora)
        model.train()
        eager_loss_function = settings.without_peft(model).loss_function
        settings.apply_settings(model, sdpa_setting(compile=compile))
        ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
        labels = ids.clone()
        labels[:, :10] = -100  # loss on the completion only
        loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(27)).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert (settings.without_peft(model).loss_function is not eager_loss_function) == compile
        return loss.detach(), grads

    eager_loss, eager_grads = loss_and_grads(False)
    compiled_loss, compiled_grads = loss_and_grads(True)
    torch.testing.assert_close(compiled_loss, eager_loss)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_layers_round_bf16_where_eager_does():
    """In bf16, compiled layers must round as eager does (settings.COMPILE_OPTIONS): inductor's
    own fusion rounds a chain once, which on real text moved 20 steps' loss 0.055 from eager's
    on the H200 (0.0017 with eager's casts emulated). Here on CPU, compiled without emulation 68%
    of this model's logits differ from eager's; with it, none."""
    import torch

    def logits(compile: bool):
        torch.manual_seed(0)
        model = tiny_qwen3(vocab_size=1000).to(torch.bfloat16)
        settings.apply_settings(model, sdpa_setting(compile=compile))
        with torch.no_grad():
            return model(input_ids=torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))).logits

    eager, compiled = logits(False), logits(True)
    torch.compiler.reset()
    assert (compiled != eager).float().mean() < 0.5


def test_fused_loss_is_bound_to_the_instance_only():
    """fused_cross_entropy: Liger's fused loss on this model, nothing patched for the process
    (a later probe candidate or the trained model must not run Liger's other kernels), and the
    same loss as the model's own. Runs where liger-kernel is installed (the GPU machine)."""
    pytest.importorskip("liger_kernel", reason="liger-kernel (and triton) is installed on GPU machines only")
    import torch
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    module = (qwen3.Qwen3RMSNorm, qwen3.Qwen3MLP, qwen3.apply_rotary_pos_emb, qwen3.Qwen3ForCausalLM.forward)
    torch.manual_seed(0)
    model = tiny_qwen3(vocab_size=64)
    ids = torch.randint(0, 64, (2, 16))
    own = model(input_ids=ids, labels=ids).loss
    settings.fused_loss(model)
    assert model.forward.__func__ is not qwen3.Qwen3ForCausalLM.forward
    assert (qwen3.Qwen3RMSNorm, qwen3.Qwen3MLP, qwen3.apply_rotary_pos_emb, qwen3.Qwen3ForCausalLM.forward) == module
    assert type(model.model.norm) is qwen3.Qwen3RMSNorm
    if torch.cuda.is_available():  # Liger's kernels are Triton: they run on a GPU
        model.cuda()
        torch.testing.assert_close(model(input_ids=ids.cuda(), labels=ids.cuda()).loss.cpu(), own.detach(),
                                   rtol=1e-4, atol=1e-4)
    model.config.model_type = "no_such_type"
    with pytest.raises(ValueError, match="no fused loss for model type 'no_such_type'"):
        settings.fused_loss(model)


def test_the_probe_measures_the_rows_each_method_runs(monkeypatch):
    """A preference pair is two sequences in one forward (TRL's collator stacks chosen and
    rejected), so the probe measures micro-batch x 2 rows for it; a GRPO row is its prompt and a
    sampled completion, so it measures prompts of data.max_length plus the completion's tokens.
    The shape is the method's row of the method table: change the row and the probe follows."""
    import dataclasses

    from stages.engine.recipe import TrainSection
    from stages.train.methods import METHODS

    def shape(method, micro=4, max_length=1024, completion=256):
        recipe = SimpleNamespace(train=TrainSection(method=method, max_completion_length=completion),
                                 data=SimpleNamespace(max_length=max_length))
        return autotune.batch_shape(recipe, micro)

    for method in ("dpo", "orpo", "reward"):
        assert shape(method) == (8, 1024)
    assert shape("grpo", max_length=512) == (4, 768)
    assert shape("sft") == shape("cpt") == (4, 1024)
    monkeypatch.setitem(METHODS, "sft", dataclasses.replace(METHODS["sft"], sequences=3, sampled=True))
    assert shape("sft") == (12, 1280)


# Cold probes of qwen3_8b's shape (LoRA r16, 8 sequences of 2048 a step) on the lent H100,
# 2026-11-26, each in a fresh process with fresh inductor and Triton caches: tokens/s, peak GiB and
# seconds per measurement (building the model, compiling, steps), from
# bench/results/autotune_qwen3-8b_lora_2048_gb8_h100_2026-11-26_run1.json and, for the setting
# the search before the memory floor compiled to an out-of-memory, _exhaustive.json.
H100_8B = {  # (attention, checkpointing, micro-batch, compiled): (tokens/s, GiB, seconds)
    ("flash_attention", "full", 1, False): (None, 0, 4.8),  # the first: builds the one model
    ("cudnn_attention", "full", 1, False): (None, 0, 0.0),
    ("efficient_attention", "full", 1, False): (3546, 19.9, 2.7),
    ("efficient_attention", "off", 1, False): (4712, 33.5, 1.9),
    ("flex_attention", "off", 8, True): (None, 0, 15.1),  # out of memory
    ("flex_attention", "off", 4, True): (15584, 58.5, 24.3),
    ("efficient_attention", "off", 4, True): (10561, 63.0, 8.5),
}


def replay(table: dict, clock: list):
    """measure() from a table, advancing a fake clock by what each measurement cost."""
    def measure(s):
        speed, gib, seconds = table[shape(s)]  # a KeyError: the search measured what the H100 runs did not
        clock[0] += seconds
        if speed is None:
            return {"error": "OutOfMemoryError: CUDA out of memory" if gib == 0 and seconds > 10
                    else "RuntimeError: No available kernel"}
        return {"tokens_per_s": float(speed), "peak_bytes": gib * GiB, "resident_bytes": 15.8 * GiB}
    return measure


def test_a_cold_h100_probe_of_8b_measures_six_settings_in_under_a_minute(monkeypatch):
    """The cold H100 probe that took 145 s and 19 measurements with the search before this one
    (bench/results/..._exhaustive.json) chose flex, no checkpointing, micro-batch 4, compiled;
    this search picks the same in six measurements, 38 s of them, and never compiles 8."""
    clock = [0.0]
    monkeypatch.setattr(autotune, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # this module's clock only
    found = autotune.search(replay(H100_8B, clock), autotune.attention_candidates(CUDA), global_batch=8,
                            example_tokens=2048, deadline=300, total_memory=80 * GiB)
    d = found["decisions"]
    assert (d["attn_implementation"], d["gradient_checkpointing"], d["micro_batch_size"], d["compile"]) == \
        ("flex_attention", "off", 4, True)
    assert len(found["measurements"]) == 6 and clock[0] < 45
    assert ("flex_attention", "off", 8, True) not in [shape(m) for m in found["measurements"]]


def small_qwen3(layers: int = 4, peft: bool = False):
    """A random Qwen3 of `layers` decoder layers in bf16 on the CPU, LoRA on every projection if asked."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return model


@pytest.mark.parametrize("peft", [False, True])
def test_a_slice_runs_the_first_layers_only_and_gives_the_model_back_whole(peft):
    """A sharded run's probe times slices of its model: inside first_layers(model, k) a step runs
    decoder layers 0..k-1 and no other, gradients reach those layers only, and afterwards the model
    runs every layer again, with or without PEFT's wrapper."""
    import torch

    model = small_qwen3(4, peft)
    layers = settings.decoder_layers(model)
    ran = []
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    ids = torch.randint(0, 128, (1, 16))
    with autotune.first_layers(model, 2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert ran == [0, 1]
    grads = [any(p.grad is not None for p in layer.parameters()) for layer in layers]
    assert grads == [True, True, False, False]
    ran.clear()
    model(input_ids=ids)
    assert ran == [0, 1, 2, 3] and settings.decoder_layers(model) == layers


def test_parameter_counts_split_one_layer_from_the_rest():
    """What the memory model of a sharded run counts: a layer's parameters and the rest's (embeddings,
    final norm, head), trainable ones apart; under LoRA only the adapters are trainable, in fp32
    (PEFT's), the base frozen in bf16."""
    full = small_qwen3(3)
    counts = autotune.parameter_counts(full, settings.decoder_layers(full)[0])
    total = sum(p.numel() for p in full.parameters())
    assert 3 * counts["layer"]["params"] + counts["other"]["params"] == total
    assert counts["layer"]["trainable"] == counts["layer"]["params"] and counts["layer"]["frozen_bytes"] == 0
    assert counts["other"]["trainable"] == counts["other"]["params"] and counts["other"]["frozen_bytes"] == 0
    lora = small_qwen3(3, peft=True)
    counts = autotune.parameter_counts(lora, settings.decoder_layers(lora)[0])
    adapters = sum(p.numel() for n, p in settings.decoder_layers(lora)[0].named_parameters() if "lora_" in n)
    assert counts["layer"]["trainable"] == adapters > 0
    assert counts["other"]["trainable"] == 0
    assert counts["layer"]["frozen_bytes"] == 2 * (counts["layer"]["params"] - adapters)


def test_the_sharded_estimate_carries_a_layer_to_the_full_depth_and_divides_the_state():
    """Slices 2 and 4 layers deep: what the second adds per layer, carried to 10 layers (nothing
    where the deeper slice held less: its peak at the loss, the same at any depth); weights,
    gradients and AdamW state (16 bytes a trainable parameter under FSDP2's fp32 master weights)
    over the processes, plus what FSDP2 holds whole in bf16 at once: the weights outside the
    layers and their gradients, two layers' weights and one layer's gradients."""
    assert autotune.DEPTHS == (2, 4)
    shallow = {"step_seconds": 1.0, "activation_bytes": 2 * GiB, "tokens": 8192}
    deep = {"step_seconds": 1.5, "activation_bytes": 3 * GiB, "tokens": 8192}
    counts = {"layer": {"params": 100e6, "trainable": 100e6, "frozen_bytes": 0},
              "other": {"params": 50e6, "trainable": 50e6, "frozen_bytes": 0}}
    got = autotune.sharded_estimate(shallow, deep, layers=10, shards=4, counts=counts)
    assert got["step_seconds"] == 3.0 and got["tokens_per_s"] == round(8192 / 3.0, 1)
    held = (10 * 16 * 100e6 + 16 * 50e6) / 4 + 2 * (50e6 + 50e6 + 2 * 100e6 + 100e6)
    assert got["resident_bytes"] == int(held)  # what does not grow with the micro-batch
    assert got["peak_bytes"] == int(held + 6 * GiB)
    flat = autotune.sharded_estimate(deep, {**deep, "activation_bytes": 2 * GiB}, layers=10, shards=4, counts=counts)
    assert flat["peak_bytes"] == int(held + 2 * GiB)  # the deeper slice held less: no growth, never below
    lora = {"layer": {"params": 100e6, "trainable": 1e6, "frozen_bytes": 2 * 99e6},
            "other": {"params": 50e6, "trainable": 0, "frozen_bytes": 2 * 50e6}}
    two, four = (autotune.sharded_estimate(shallow, deep, 10, n, lora)["peak_bytes"] for n in (2, 4))
    assert two - four == int((10 * (2 * 99e6 + 16e6) + 2 * 50e6) / 4)  # the state, halved again
