"""Models built from a config (model.config): a Qwen3-architecture model (or Qwen3-MoE) with random
weights from a fixed seed. The tiny default gets a character-level tokenizer with ChatML special
tokens made here, so it needs no download; a recipe that names a tokenizer directory (e.g.
Qwen3's own) gets that tokenizer and its vocabulary instead, at any size up to Qwen3-8B's
shape, for GPU runs where real weights cannot be fetched. Nothing about real models depends
on the character-level tokenizer.

A recipe for a GPU profile gets its weights made on the GPU where one is visible (an 8B shape in
seconds, where the CPU takes minutes): the same bytes on every run on the same kind of GPU, other
bytes than the CPU's (its random numbers differ), so the base stage's key names the device
(stages/base.py). A CPU profile's (tiny's) are made on the CPU on every machine."""
from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = ["\n"] + [chr(i) for i in range(32, 127)]

# Qwen3's ChatML layout without tools or thinking: <|im_start|>role\ncontent<|im_end|>\n
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def char_tokenizer():
    """A character-level tokenizer with ChatML special tokens: tiny, exact, deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def build_from_config(cfg, out: Path, root: Path = Path("."), on_gpu: bool = False) -> None:
    """Random weights from cfg.seed, saved with the tokenizer; cfg.tokenizer is relative to root.
    on_gpu: made on the GPU where one is visible (a GPU profile's base)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3MoeConfig

    tok = char_tokenizer() if cfg.tokenizer is None else AutoTokenizer.from_pretrained(root / cfg.tokenizer)
    vocab = 64 * ((len(tok) + 63) // 64)  # padded to a multiple of 64 for matmul shapes
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    moe = cfg.architecture == "Qwen3MoeForCausalLM"
    config = (Qwen3MoeConfig if moe else Qwen3Config)(
        vocab_size=cfg.vocab_size or vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id, dtype=cfg.dtype,
        **({"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size} if moe else {}))
    torch.manual_seed(cfg.seed)  # seeds the GPU's generator too
    device = init_device(config, getattr(torch, cfg.dtype)) if on_gpu else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def init_device(config, dtype) -> str:
    """Where from_config makes the weights: "cuda" when a GPU is visible, else "cpu". A model whose
    weights would not fit the GPU's memory is refused (not moved to the CPU, which would write other
    bytes under the same key)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        return "cpu"
    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(config, dtype=dtype)
    need = sum(p.numel() * p.element_size() for p in shape.parameters())
    total = torch.cuda.get_device_properties(0).total_memory
    if need > 0.9 * total:
        from stages.engine.errors import UserError

        raise UserError(f"model.config: {need / 1e9:.1f} GB of weights do not fit the GPU's {total / 1e9:.1f} GB, "
                        f"where a GPU profile's config-built base is made; build it on a machine with a larger GPU "
                        f"and doit push it, or make the model smaller")
    return "cuda"
