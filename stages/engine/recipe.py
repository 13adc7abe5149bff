"""The recipe: one YAML file that says what model to produce.

Pydantic v2 models, extra=forbid and frozen, so a typo is an error and a loaded
recipe cannot drift while the graph runs. Errors are one line naming the file,
the key path, and (where the YAML says) the line.
"""
from __future__ import annotations

import re
from pathlib import Path, PurePath, PureWindowsPath
from typing import Annotated, Literal, Optional, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stages.engine.errors import UserError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def inside_project(path: str | None) -> str | None:
    """A data file or model directory is named relative to the project and inside it, so the
    recipe, and the receipt that records it, read the same on every machine (the content's
    digest is what the keys use; a symlink inside the project may point anywhere)."""
    if path is not None and (PurePath(path).is_absolute() or PureWindowsPath(path).is_absolute()
                             or ".." in PurePath(path).parts):
        raise ValueError(f"{path} is outside the project; put the file (or a symlink to it) under "
                         f"the project, e.g. data/, and name it relative to the project")
    return path


ProjectPath = Annotated[Optional[str], AfterValidator(inside_project)]


class ModelConfig(Section):
    """A Qwen3-architecture model built from its config with a fixed seed (random weights).
    With no tokenizer, a character-level one is made here (the tiny default, no download);
    with tokenizer: a Hugging Face tokenizer directory (e.g. Qwen3's), whose vocabulary the
    model gets unless vocab_size says otherwise (Qwen3 pads 151,669 tokens to 151,936).
    Qwen3MoeForCausalLM makes it a mixture of experts (num_experts and the two below)."""
    architecture: Literal["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"] = "Qwen3ForCausalLM"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(16, gt=0)
    max_position_embeddings: int = Field(1024, gt=0)
    tokenizer: ProjectPath = None
    vocab_size: Optional[int] = Field(None, gt=0)
    tie_word_embeddings: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"  # of the saved weights: bf16 halves an 8B's 33 GB
    num_experts: int = Field(4, gt=1)  # Qwen3MoeForCausalLM only, as the three below
    num_experts_per_tok: int = Field(2, gt=0)
    moe_intermediate_size: int = Field(64, gt=0)
    seed: int = 0


class ModelSection(Section):
    """Exactly one of: hub (pinned to a revision), path (a local HF dir), config (built here)."""
    hub: Optional[str] = None
    revision: Optional[str] = None
    path: ProjectPath = None
    config: Optional[ModelConfig] = None

    @model_validator(mode="after")
    def one_source(self):
        given = [k for k in ("hub", "path", "config") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of hub, path, config (got {given or 'none'})")
        if self.hub and not self.revision:
            raise ValueError("a hub model needs a pinned revision (a commit sha)")
        return self


class Source(Section):
    """A local file (path) or a hub dataset pinned to a revision (hub + revision)."""
    path: ProjectPath = None
    hub: Optional[str] = None
    revision: Optional[str] = None
    subset: Optional[str] = None
    split: str = "train"
    format: Literal["auto", "chat", "alpaca", "text", "preference", "prompt"] = "auto"
    file_format: Literal["auto", "jsonl", "json", "parquet", "csv"] = "auto"

    @model_validator(mode="after")
    def one_place(self):
        if (self.path is None) == (self.hub is None):
            raise ValueError("give exactly one of path and hub")
        if self.hub and not self.revision:
            raise ValueError("a hub dataset needs a pinned revision (a commit sha)")
        return self


class DedupeSection(Section):
    """Exact duplicates always go; near duplicates when near_threshold is set (MinHash LSH)."""
    near_threshold: Optional[float] = Field(0.6, gt=0.0, le=1.0)
    num_perm: int = Field(128, ge=16)
    ngram: int = Field(2, ge=1)  # word n-grams; 2 keeps a few changed words in a short row similar


class FiltersSection(Section):
    min_tokens: int = Field(1, ge=1)
    max_tokens: Optional[int] = Field(None, gt=0)  # longer rows are dropped, whatever truncation says
    max_repetition: Optional[float] = Field(0.5, gt=0.0, le=1.0)


class DataSection(Section):
    sources: list[Source] = Field(min_length=1)
    heldout_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    max_length: int = Field(256, gt=8)
    # a row longer than this (a JSON line's bytes, or a record's text) is dropped unread, counted
    # as oversized: whatever max_length is, it would cost memory and time in proportion to its size
    max_row_bytes: int = Field(8 << 20, gt=0)
    truncation: Literal["drop", "truncate"] = "drop"
    on_error: Literal["fail", "skip"] = "fail"
    dedupe: DedupeSection = DedupeSection()
    filters: FiltersSection = FiltersSection()
    seed: int = 0


class LoraSection(Section):
    r: int = Field(8, gt=0)
    alpha: int = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | list[str] = "all-linear"
    # nn.Parameters (not Linear modules) to adapt, e.g. MoE experts' fused weights
    # ("mlp.experts.gate_up_proj"): PEFT's target_parameters
    target_parameters: Optional[list[str]] = None


class TrainSection(Section):
    method: Literal["sft", "cpt", "dpo", "orpo", "grpo", "gspo", "reward", "kto"] = "sft"
    peft: Literal["none", "lora", "qlora"] = "none"  # qlora: LoRA over the base loaded in 4-bit NF4 (CUDA)
    lora: LoraSection = LoraSection()
    lr: float = Field(1e-3, gt=0)
    max_steps: int = Field(100, gt=0)
    micro_batch_size: int = Field(8, gt=0)
    grad_accum: int = Field(1, gt=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    save_steps: int = Field(25, gt=0)
    seed: int = 0
    beta: float = Field(0.1, gt=0)  # dpo, kto: KL strength; orpo: the odds-ratio term's weight
    reward: str = "exact_answer"  # grpo, gspo: a name in stages/train/verifiers.py's REWARDS
    num_generations: int = Field(4, gt=1)  # grpo, gspo: completions sampled per prompt
    max_completion_length: int = Field(16, gt=0)  # grpo, gspo: tokens generated per completion

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: the plan may re-split it, never change it."""
        return self.micro_batch_size * self.grad_accum


class HardwareSection(Section):
    profile: Literal["cpu", "h100", "h200", "mi300x", "gfx1100", "gfx1151"] = "cpu"
    gpus: int = Field(1, ge=1)
    sharding: Literal["auto", "fsdp2"] = "auto"  # auto: each GPU holds the whole model where a LoRA run's
    # replica fits one (DDP: only the adapter's gradients cross GPUs), FSDP2 otherwise; fsdp2: always shard

    @model_validator(mode="after")
    def mi300x_topology(self):
        if self.profile == "mi300x" and self.gpus not in (1, 8):
            raise ValueError(
                f"gpus={self.gpus} on mi300x: use 1 or 8 (its xGMI fabric is tuned for a full node or one GPU)")
        return self


class AutotuneSection(Section):
    enabled: bool = True
    budget_seconds: float = Field(60, gt=0)


class EvalSection(Section):
    limit: Optional[int] = Field(None, gt=0)
    max_new_tokens: int = Field(16, gt=0)
    batch_size: int = Field(16, gt=0)


SCHEMES = ("fp8", "mxfp4")  # Quark's scheme names: FP8 E4M3 per tensor, OCP MXFP4 (FP4 in blocks of 32, E8M0 scales)


class QuantizeSection(Section):
    """One Quark scheme, several to compare (each exported and scored beside the others), or none."""
    scheme: Union[Literal["fp8", "mxfp4", "none"], list[Literal["fp8", "mxfp4"]]] = "fp8"
    calibration_sequences: int = Field(16, gt=0)

    @field_validator("scheme", mode="before")
    @classmethod
    def known_and_distinct(cls, value):
        """One clear line for a bad scheme, instead of one error per branch of the union."""
        names = value if isinstance(value, list) else [value]
        wrong = [v for v in names if v not in SCHEMES and not (v == "none" and not isinstance(value, list))]
        if wrong or not names or len(set(names)) < len(names):
            raise ValueError(f"{value!r}: give one of {', '.join(SCHEMES)}, a list of them (each once), or none")
        return value

    @property
    def schemes(self) -> tuple[str, ...]:
        """The schemes to export, in the recipe's order (none for 'none')."""
        scheme = self.scheme
        return () if scheme == "none" else (scheme,) if isinstance(scheme, str) else tuple(scheme)


HUB_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


class PublishSection(Section):
    """The model card's license and where `doit publish:<recipe>` uploads the build (--repo
    overrides `repo`): a Hub model repo, owner/name. Not part of the receipt: where a model is
    published is no part of what it proves."""
    license: Optional[str] = Field(None, pattern=r"^[a-z0-9][a-z0-9.+-]*$")  # a Hub license id, e.g. apache-2.0
    repo: Optional[str] = None
    private: bool = True

    @field_validator("repo")
    @classmethod
    def hub_repo(cls, value):
        if value is not None and not HUB_REPO.fullmatch(value):
            raise ValueError(f"{value!r} is not a Hub repo id: give owner/name (letters, digits, . _ -)")
        return value


class ServeSection(Section):
    """How `doit serve:<recipe>` serves the build (--host and --port override these). No artifact
    reads it and it is no part of the receipt: where a model is served changes nothing it proves."""
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)


class AnchorSection(Section):
    """Whether and where `doit anchor:<recipe>` records the manifest's digest. A recipe anchors
    only if it names `registry` (a registry contract, contracts/AnchorRegistry.sol) and its
    `chain_id`: pinned here, in committed config, because `doit verify` trusts these and not
    what anchor.json says; ops/anchor.yaml pins the accounts trusted to anchor in that registry
    (docs/anchoring.md). For one shell the environment overrides a value given here
    (MINDXTRAIN_ANCHOR_REGISTRY, _CHAIN_ID, _RPC_URL, _KEYSTORE). The signing key is never here:
    MINDXTRAIN_ANCHOR_KEY, or the encrypted keystore file `keystore` names with its password in
    MINDXTRAIN_ANCHOR_PASSWORD."""
    rpc_url: Optional[str] = None
    registry: Optional[str] = None  # the contract's address, 0x and 40 hex digits; none: not anchored
    chain_id: Optional[int] = Field(None, gt=0)  # the registry's chain: the node must be on it
    keystore: Optional[str] = None  # an encrypted JSON keystore (Ethereum's Web3 Secret Storage)
    uri: str = ""  # recorded on chain beside the digest: where the artifacts can be found

    @model_validator(mode="after")
    def both_pinned(self):
        if (self.registry is None) != (self.chain_id is None):
            raise ValueError("give registry and chain_id together (the registry's address and the chain it is "
                             "on), or neither for a recipe that is not anchored")
        return self


class ChecksSection(Section):
    """Warnings before a wasted run (doit check:<recipe>, run before training): one loud line
    each, or a failed build with as_errors. No artifact reads these: changing them rebuilds nothing."""
    max_dropped_fraction: float = Field(0.5, gt=0.0, le=1.0)  # of the rows read, dropped for any reason
    max_epochs: float = Field(10.0, gt=0.0)  # passes of train.max_steps over the training sequences
    as_errors: bool = False


class Recipe(Section):
    model: ModelSection
    data: DataSection
    train: TrainSection = TrainSection()
    hardware: HardwareSection = HardwareSection()
    autotune: AutotuneSection = AutotuneSection()
    eval: EvalSection = EvalSection()
    quantize: QuantizeSection = QuantizeSection()
    serve: ServeSection = ServeSection()
    publish: PublishSection = PublishSection()
    anchor: AnchorSection = AnchorSection()
    checks: ChecksSection = ChecksSection()


RECIPE_NAME = re.compile(r"[A-Za-z0-9_-]+")


def check_name(path: Path) -> str:
    """A recipe's name (its file's stem), which names its tasks and its pointer directory:
    letters, digits, _ and - only, so it can be neither a path (.., a/b) nor a doit separator (:)."""
    if not RECIPE_NAME.fullmatch(path.stem):
        raise UserError(f"{path}: a recipe name is letters, digits, _ and - only; rename the file "
                        f"(e.g. {re.sub(r'[^A-Za-z0-9_-]+', '_', path.stem).strip('_') or 'recipe'}.yaml)")
    return path.stem


class DuplicateKey(Exception):
    pass


def _key_lines(text: str) -> dict[tuple, int]:
    """Map each key path in the YAML to its 1-based line, so errors can point at it; a key
    given twice in one mapping raises DuplicateKey (YAML loaders keep the last one silently)."""
    lines: dict[tuple, int] = {}

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                p = path + (k.value,)
                if p in lines:
                    raise DuplicateKey(f":{k.start_mark.line + 1}: {'.'.join(map(str, p))} is given twice "
                                       f"(lines {lines[p]} and {k.start_mark.line + 1}); keep one")
                lines[p] = k.start_mark.line + 1
                walk(v, p)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[path + (i,)] = v.start_mark.line + 1
                walk(v, path + (i,))

    walk(yaml.compose(text), ())
    return lines


def where(path: Path, key: str) -> str:
    """path:line of a dotted key (data.sources.0.path) in a recipe file, or of the nearest key above
    it that the file gives (a default is not written there); just the path where none is."""
    try:
        lines = _key_lines(Path(path).read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, DuplicateKey):
        return str(path)
    parts = tuple(int(p) if p.isdigit() else p for p in key.split("."))
    line = next((lines[parts[:i]] for i in range(len(parts), 0, -1) if parts[:i] in lines), None)
    return f"{path}:{line}" if line else str(path)


# A recipe is a page of settings: these bounds are orders of magnitude above any real one and far
# below what would cost memory or a RecursionError (YAML's aliases repeat a node without copying
# it, so a few lines can stand for a billion: the bound is on the expanded size).
MAX_RECIPE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000


def bounded(path: Path, text: str) -> None:
    """Refuse, before anything is built from it, a YAML text nested deeper than MAX_DEPTH or whose
    aliases expand to more than MAX_NODES nodes. Walks the parser's events, which PyYAML makes
    without recursion, counting each alias as the size of the node it repeats."""
    sizes: dict[str, int] = {}  # anchor -> expanded size of its node
    open_nodes: list[list] = []  # [anchor, size so far] of each collection being read
    total = 0

    def add(size: int, own: int, mark) -> None:
        """Count a node of `size` expanded values, `own` of them not counted yet."""
        nonlocal total
        total += own
        if open_nodes:
            open_nodes[-1][1] += size
        if total > MAX_NODES:
            raise UserError(f"{path}:{mark.line + 1}: the YAML expands to more than {MAX_NODES:,} values "
                            f"(aliases repeating aliases?); write the recipe out plainly")

    try:
        for event in yaml.parse(text):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                if len(open_nodes) >= MAX_DEPTH:
                    raise UserError(f"{path}:{event.start_mark.line + 1}: the YAML is nested more than "
                                    f"{MAX_DEPTH} levels deep; a recipe needs a few")
                open_nodes.append([event.anchor, 1])
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, size = open_nodes.pop()
                if anchor is not None:
                    sizes[anchor] = size
                add(size, 1, event.start_mark)  # its contents are counted already
            elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
                if isinstance(event, yaml.AliasEvent) and any(event.anchor == anchor for anchor, _ in open_nodes):
                    raise UserError(f"{path}:{event.start_mark.line + 1}: *{event.anchor} repeats a node inside "
                                    f"itself (a recursive alias); write the recipe out plainly")
                size = sizes.get(event.anchor, 1) if isinstance(event, yaml.AliasEvent) else 1
                if isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
                    sizes[event.anchor] = 1
                add(size, size, event.start_mark)
    except yaml.YAMLError:
        return  # the loader below reports it with its line


# What PyYAML's safe constructors raise for a value they cannot build: a date of 30 February or an
# integer past Python's 4,300 digits (ValueError), an explicit tag on a value it does not fit
# (!!bool foo: KeyError; !!timestamp foo: AttributeError).
UNBUILDABLE = (ValueError, KeyError, AttributeError, TypeError)


def unbuildable_line(text: str) -> str:
    """':<line>' of the first scalar that PyYAML's safe loader cannot build, found node by node;
    '' where none is found (a merge key's own scalar is not a value, and is passed over)."""
    loader = yaml.SafeLoader(text)
    try:
        nodes = [loader.get_single_node()]
        while nodes:  # bounded() has refused recursive aliases, so this walk ends
            node = nodes.pop()
            if isinstance(node, yaml.ScalarNode):
                try:
                    loader.construct_object(node)
                except UNBUILDABLE:
                    return f":{node.start_mark.line + 1}"
                except yaml.YAMLError:
                    continue
            elif isinstance(node, yaml.SequenceNode):
                nodes += reversed(node.value)
            elif isinstance(node, yaml.MappingNode):
                nodes += reversed([n for pair in node.value for n in pair])
    except yaml.YAMLError:
        return ""
    finally:
        loader.dispose()
    return ""


def load(path: str | Path) -> Recipe:
    """Parse and validate a recipe file; raise UserError with one clear line."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise UserError(f"{path}: cannot read recipe ({e.strerror})") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise UserError(f"{path}: over {MAX_RECIPE_BYTES >> 20} MiB; a recipe is a page of settings "
                        f"(put data in data files and name them in data.sources)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 (byte {e.start}); save the recipe as UTF-8") from None
    bounded(path, text)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{path}{where}: YAML syntax error: {problem}") from None
    except UNBUILDABLE as e:  # a value YAML reads as a date or number that cannot be one: 2001-02-30
        raise UserError(f"{path}{unbuildable_line(text)}: YAML cannot build a value (a date or number that cannot "
                        f"be one, or a tag that does not fit it: {str(e).split(';')[0]}); quote it if it is "
                        f"text") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe is a YAML mapping with model: and data: sections")
    try:
        lines = _key_lines(text)
    except DuplicateKey as e:
        raise UserError(f"{path}{e}") from None
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(x for x in err["loc"] if not str(x).startswith("function-"))
        line = next((lines[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in lines), None)
        where = f":{line}" if line else ""
        key = ".".join(str(x) for x in loc) or "(top)"
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (+{e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise UserError(f"{path}{where}: {key}: {msg}{more}") from None
