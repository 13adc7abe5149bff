"""base: the base model + tokenizer as an artifact.

Three sources: a hub id pinned to a revision (downloaded once through
huggingface_hub, then copied), a local HF directory (copied byte for byte), or a
config (tiny: a Qwen3-architecture model initialised with a fixed seed, with a
character-level tokenizer this module builds, so the default needs no download).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from stages.errors import UserError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = ["\n"] + [chr(i) for i in range(32, 127)]

# Qwen3's ChatML layout without tools or thinking: <|im_start|>role\ncontent<|im_end|>\n
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


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


def build_from_config(cfg, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok = char_tokenizer()
    vocab = 64 * ((len(tok) + 63) // 64)  # padded to a multiple of 64 for matmul shapes
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        dtype="float32")
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def copy_model_dir(src: Path, out: Path) -> None:
    """Copy the files a causal LM needs, refusing a directory that lacks them."""
    if not (src / "config.json").is_file():
        raise UserError(f"{src}: not a Hugging Face model directory (no config.json); "
                        f"point model.path at a directory saved with save_pretrained")
    if not any(src.glob("*.safetensors")):
        raise UserError(f"{src}: no *.safetensors weights; re-save the model with safe_serialization")
    for p in sorted(src.iterdir()):
        if p.is_file() and any(p.match(pat) for pat in MODEL_FILE_PATTERNS):
            shutil.copyfile(p, out / p.name)


def extra_inputs(recipe, root: Path, store) -> dict:
    """A local model dir is an input: its content, not its path, goes into the key."""
    m = recipe.model
    if m.path is None:
        return {}
    src = (root / m.path)
    if not src.is_dir():
        raise UserError(f"recipe model.path: {m.path} is not a directory")
    return {p.name: store.stat.digest(p) for p in sorted(src.iterdir())
            if p.is_file() and any(p.match(pat) for pat in MODEL_FILE_PATTERNS)}


def build(ctx, out: Path) -> None:
    m = ctx.recipe.model
    if m.config is not None:
        ctx.log.info("building a Qwen3 model from config (seed %d)", m.config.seed)
        build_from_config(m.config, out)
    elif m.path is not None:
        ctx.log.info("copying local model %s", m.path)
        copy_model_dir(ctx.root / m.path, out)
    else:
        from huggingface_hub import snapshot_download

        ctx.log.info("fetching %s@%s", m.hub, m.revision)
        src = snapshot_download(m.hub, revision=m.revision, allow_patterns=list(MODEL_FILE_PATTERNS))
        copy_model_dir(Path(src), out)
