"""The stage table: every stage of the build, one row each, in build order.

A row is deps + params + outs, nothing hidden (stages/engine/stage.py): the recipe
paths the stage reads, the files of each upstream artifact it reads (by pattern; `optional=`
for an upstream read only where it is built for this build), the libraries whose versions shape
its output, and its module, whose build(ctx, out) makes the artifact. A row reads only rows
above it. The build sees nothing else: reading an undeclared recipe field or opening an
undeclared upstream file fails (stages/engine/declared.py). To add a stage, write its module
beside the others and add its row here; dodo.py makes a task of every row.
"""
from __future__ import annotations

from stages.engine.recipe import Recipe
from stages.engine.stage import Stage

MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*",
               "chat_template.jinja", "special_tokens_map.json")
TOKENIZER_FILES = ("tokenizer*", "chat_template.jinja", "special_tokens_map.json")
TRAINED = ("model/*", "adapter/*")
# the recipe as the receipt records it: where it is served, anchored or published is no part of what it proves
RECEIPT_SECTIONS = tuple(name for name in Recipe.model_fields if name not in ("serve", "anchor", "publish"))
# Quark's import (12-20 s on the lent GPU hosts), for the quantized stage and for loading its exports;
# our module first, which sets what Quark reads as it imports
QUARK = ("stages.model.quark", "quark.torch")
RECEIPT_PACKAGES = ("python", "torch", "transformers", "tokenizers", "peft", "trl", "accelerate", "datasets",
                    "lm-eval", "amd-quark", "safetensors", "blake3", "doit", "pydantic")

STAGES = {s.name: s for s in [
    Stage("base", "stages.base", ("model", "hardware.profile"), {}, ("torch", "transformers"),
          "the base model + tokenizer as an artifact"),
    Stage("plan", "stages.plan", ("hardware", "autotune", "train.method", "train.peft", "train.lora",
                                  "train.micro_batch_size", "train.grad_accum", "train.max_completion_length",
                                  "data.max_length"),
          {"base": ("config.json",)}, ("torch", "transformers", "peft"),
          "plan.json: the decisions training applies verbatim"),
    Stage("shards", "stages.shards", ("data", "train.method"), {"base": TOKENIZER_FILES},
          ("transformers", "tokenizers", "datasets", "datasketch", "blake3"),
          "tokenized, masked, packed shards + stats.json"),
    Stage("checkpoint", "stages.checkpoint", ("train",),
          {"base": MODEL_FILES, "shards": ("train/*",), "plan": ("plan.json",)},
          ("torch", "transformers", "trl", "peft", "accelerate", "datasets"),
          "trained weights or PEFT adapter + metrics.jsonl", after=("check",)),
    Stage("quantized", "stages.quantized", ("quantize",),
          {"base": MODEL_FILES, "checkpoint": TRAINED, "shards": ("train/*",), "plan": ("plan.json",)},
          ("torch", "transformers", "peft", "amd-quark"),
          "Quark exports in HF format, one per scheme (LoRA merged first)", preload=QUARK + ("peft",)),
    Stage("eval", "stages.eval", ("eval", "train.method", "train.reward"),
          {"base": MODEL_FILES, "checkpoint": TRAINED, "quantized": ("*/*",),
           "shards": ("heldout/*",), "plan": ("plan.json",)},
          ("torch", "transformers", "peft", "lm-eval", "amd-quark", "datasets"),
          "eval.json from lm-eval: base, trained and each quantized model scored and sized",
          preload=QUARK + ("peft", "lm_eval.evaluator", "lm_eval.models.huggingface", "lm_eval.tasks")),
    Stage("manifest", "stages.manifest", RECEIPT_SECTIONS,
          {s: ("*",) for s in ("base", "plan", "shards", "checkpoint", "quantized", "eval")},
          RECEIPT_PACKAGES, "manifest.json: BLAKE3 of everything", records_keys=True),
    Stage("anchor", "stages.anchor", ("anchor.registry", "anchor.chain_id"), {"manifest": ("manifest.json",)}, (),
          "anchor.json: the manifest's digest anchored in a write-once registry on a chain",
          settings=("anchor.rpc_url", "anchor.keystore", "anchor.uri")),
    Stage("report", "stages.report", (),
          {"manifest": ("manifest.json",), "eval": ("eval.json",), "shards": ("stats.json", "dropped.jsonl"),
           "checkpoint": ("metrics.jsonl",)},
          ("jinja2", "matplotlib"), "report.html: scores, loss curve, data, plan, stages, anchor (for people)",
          runs=("base", "plan", "shards", "checkpoint", "quantized", "eval", "manifest"),
          optional={"anchor": ("anchor.json",)}),
    Stage("card", "stages.card", ("publish.license",), {"manifest": ("manifest.json",), "eval": ("eval.json",)},
          ("huggingface-hub",), "README.md: the model card, as the Hugging Face Hub reads one",
          optional={"anchor": ("anchor.json",)}),
]}
