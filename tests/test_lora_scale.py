"""LoRA's scale in B's weight and A's product shared per input (stages/train/lora_scale.py): the
same loss and gradients as PEFT's own forward (to the bit with one A product per projection,
within rounding with them shared), PEFT's forward wherever the case is not plain LoRA, and
PEFT's modules as they were after. A tiny Qwen3 on the CPU with PEFT's real LoRA."""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from peft.tuners.lora import Linear
from transformers import AutoModelForCausalLM, Qwen3Config

from stages.train.lora_scale import plain_lora, scale_in_weight

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, vocab_size=100)


def lora_model(alpha=8, dropout=0.0, dtype=torch.float32):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**CONFIG), dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=alpha, lora_dropout=dropout, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero, which would leave A's gradient zero
                p.normal_(std=0.1)
    return model


IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, exact=True):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 2 * 7 * CONFIG["num_hidden_layers"]
    check = torch.equal if exact else (lambda x, y: torch.allclose(x, y, rtol=1e-4, atol=1e-6))
    assert check(loss_a, loss_b)
    assert all(check(grads_a[k], grads_b[k]) for k in grads_a)


def test_a_power_of_two_scale_gives_peft_values_to_the_bit():
    model = lora_model(alpha=8)  # scale 2: the default alpha = 2r
    peft = loss_and_grads(model)
    with scale_in_weight(model, share_inputs=False):
        ours = loss_and_grads(model)
    assert_same(ours, peft)


def test_a_shared_a_product_gives_peft_values_within_rounding():
    """One lora_A matmul for q/k/v and one for gate/up: 2 groups a layer, each member's slice."""
    from stages.train.lora_scale import groups

    model = lora_model(alpha=8)
    assert len(groups(model, [m for m in model.modules() if isinstance(m, Linear)])) == 5 * CONFIG["num_hidden_layers"]
    peft = loss_and_grads(model)
    with scale_in_weight(model):
        ours = loss_and_grads(model)
    assert_same(ours, peft, exact=False)


def test_a_member_called_with_another_input_computes_its_own_product():
    """A model whose q, k and v read different inputs still gets each projection's own values."""
    model = lora_model()
    attention = model.base_model.model.model.layers[0].self_attn
    x, y = torch.randn(3, CONFIG["hidden_size"]), torch.randn(3, CONFIG["hidden_size"])
    with torch.no_grad():
        want = [attention.q_proj(x), attention.k_proj(y), attention.v_proj(y), attention.q_proj(y)]
        with scale_in_weight(model):
            got = [attention.q_proj(x), attention.k_proj(y), attention.v_proj(y), attention.q_proj(y)]
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))


def test_any_scale_gives_peft_values_within_rounding():
    model = lora_model(alpha=5)  # scale 1.25
    peft = loss_and_grads(model)
    with scale_in_weight(model):
        ours = loss_and_grads(model)
    assert_same(ours, peft, exact=False)


def test_bf16_under_autocast_with_fp32_adapters_as_training_runs():
    model = lora_model(dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)  # PEFT upcasts them
    with disable_input_dtype_casting(model), torch.autocast("cpu", dtype=torch.bfloat16):
        peft = loss_and_grads(model)
        with scale_in_weight(model, share_inputs=False):
            x = torch.randn(3, CONFIG["hidden_size"], dtype=torch.bfloat16)
            assert {plain_lora(m, x, (), {}) for m in model.modules() if isinstance(m, Linear)} == {"default"}
            ours = loss_and_grads(model)
        with scale_in_weight(model):
            shared_loss, shared = loss_and_grads(model)
    assert_same(ours, peft)
    assert abs(shared_loss - peft[0]) < 1e-2  # bf16: the input's gradient summed in another order
    assert all((shared[k] - g).norm() <= 0.02 * g.norm() for k, g in peft[1].items())


def test_peft_forward_where_the_case_is_not_plain_lora():
    model = lora_model(dropout=0.1)  # a dropout mask per projection: PEFT's forward, same masks by seed
    x = torch.randn(3, CONFIG["hidden_size"])
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    assert plain_lora(layer, x, (), {}) is None
    model.train()
    peft = loss_and_grads(model, seed=3)
    with scale_in_weight(model):
        ours = loss_and_grads(model, seed=3)
    assert_same(ours, peft)

    model = lora_model()
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    assert plain_lora(layer, x, (), {}) == "default"
    assert plain_lora(layer, x.double(), (), {}) is None  # PEFT would cast this input to the adapter's dtype
    with scale_in_weight(model), model.disable_adapter():
        assert plain_lora(layer, x, (), {}) is None
        with torch.no_grad():
            off = model(input_ids=IDS).logits
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(off, model(input_ids=IDS).logits)
    model.merge_adapter()
    assert plain_lora(layer, x, (), {}) is None


def test_peft_modules_as_they_were_after_and_after_an_error():
    model = lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="stop"):
        with scale_in_weight(model):
            assert all("forward" in m.__dict__ for m in model.modules() if isinstance(m, Linear))
            raise RuntimeError("stop")
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, Linear))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_plain_lora_does_not_run_peft_forward(monkeypatch):
    model = lora_model()

    def peft_forward(*args, **kwargs):
        raise AssertionError("PEFT's forward ran")

    monkeypatch.setattr(Linear, "forward", peft_forward)
    with scale_in_weight(model):
        loss_and_grads(model)
    with pytest.raises(AssertionError, match="PEFT's forward ran"):
        loss_and_grads(model)


def test_the_patched_forwards_trace_without_a_graph_break():
    """Training compiles each decoder layer: a patched forward dynamo cannot trace would split
    the layer's graph at every projection (two benchmark variants' functools.partial forwards did,
    under the GPU image's torch 2.11). fullgraph=True raises on any break."""
    model = lora_model()
    attention = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 5, CONFIG["hidden_size"], requires_grad=True)

    def projections(x):
        return attention.q_proj(x).sum() + attention.k_proj(x).sum() + attention.v_proj(x).sum()

    eager = projections(x)
    with scale_in_weight(model):
        compiled = torch.compile(projections, fullgraph=True, backend="aot_eager")(x)
    compiled.backward()
    assert torch.allclose(compiled, eager, rtol=1e-5) and x.grad is not None


def test_accumulated_outputs_give_peft_values_within_rounding():
    """Every projection through lora_accumulate (the low-rank product first, the base product
    added into it; in the backward, the base gradients added into the low-rank one): q/k/v and
    gate/up as groups, o and down alone."""
    from stages.train import lora_scale
    from stages.train.lora_scale import groups

    model = lora_model(alpha=5)
    modules = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(groups(model, modules, accumulate=True)) == 7 * CONFIG["num_hidden_layers"]
    peft = loss_and_grads(model)
    calls = []
    op = lora_scale.lora_accumulate

    def counted(*args):
        calls.append(len(args[1]))
        return op(*args)
    lora_scale.lora_accumulate = counted
    try:
        with scale_in_weight(model, accumulate=True):
            ours = loss_and_grads(model)
    finally:
        lora_scale.lora_accumulate = op
    assert sorted(calls) == sorted([3, 2, 1, 1] * CONFIG["num_hidden_layers"])
    assert_same(ours, peft, exact=False)


def test_accumulated_outputs_in_bf16_under_autocast():
    model = lora_model(dtype=torch.bfloat16)
    with disable_input_dtype_casting(model), torch.autocast("cpu", dtype=torch.bfloat16):
        peft = loss_and_grads(model)
        with scale_in_weight(model, accumulate=True):
            loss, grads = loss_and_grads(model)
    assert abs(loss - peft[0]) < 1e-2  # bf16: each base product added into a rounded low-rank one
    assert all((grads[k] - g).norm() <= 0.03 * g.norm() for k, g in peft[1].items())


def test_accumulate_leaves_what_it_cannot_compute_as_peft_would():
    """A base with a bias (attention_bias), a base in another dtype than the input: the shared
    or plain path, with PEFT's values."""
    from stages.train.lora_scale import accumulable

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(Qwen3Config(**CONFIG, attention_bias=True))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    attention = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(3, CONFIG["hidden_size"])
    up = model.base_model.model.model.layers[0].mlp.up_proj
    assert not accumulable(attention.q_proj, "default", x) and not accumulable(up, "default", x.double())
    assert accumulable(up, "default", x)
    peft = loss_and_grads(model)
    with scale_in_weight(model, accumulate=True):
        ours = loss_and_grads(model)
    assert_same(ours, peft, exact=False)


def test_the_accumulating_op_is_a_sound_custom_op():
    """torch.library.opcheck: its fake (meta) outputs, its autograd formula against numerical
    gradients and its registration as torch.compile sees it; an output left out of the loss
    (gradient None) counts as zero."""
    from stages.train.lora_scale import lora_accumulate

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weights = [torch.randn(5, 8, dtype=torch.float64, generator=g), torch.randn(3, 8, dtype=torch.float64, generator=g)]
    a = torch.randn(4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bs = [torch.randn(5, 2, dtype=torch.float64, generator=g, requires_grad=True),
          torch.randn(3, 2, dtype=torch.float64, generator=g, requires_grad=True)]
    torch.library.opcheck(lora_accumulate, (x, weights, a, bs))
    first, second, h = lora_accumulate(x, weights, a, bs)
    torch.testing.assert_close(first, x @ weights[0].t() + (x @ a[:2].t()) @ bs[0].t())
    torch.testing.assert_close(second, x @ weights[1].t() + (x @ a[2:].t()) @ bs[1].t())
    first.sum().backward()
    want = torch.autograd.grad((x @ weights[0].t() + (x @ a[:2].t()) @ bs[0].t()).sum(), (x, a))
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(a.grad, want[1])
    assert torch.equal(bs[1].grad, torch.zeros_like(bs[1]))


def test_accumulate_traces_without_a_graph_break():
    model = lora_model()
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 5, CONFIG["hidden_size"], requires_grad=True)
    eager = mlp(x)
    with scale_in_weight(model, accumulate=True):
        compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    compiled.sum().backward()
    assert x.grad is not None
