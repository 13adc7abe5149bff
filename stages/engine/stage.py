"""A stage: one row of the stage table (stages/table.py), and the module it names.

A row is deps + params + outs, nothing hidden: the recipe paths the stage reads, the upstream
files it reads (by pattern, so a stage that reads only shards/train/ is not invalidated by a
change to shards/stats.json), the library versions that shape its output, and the module whose
build(ctx, out) makes its artifact. Its build sees only those (stages/engine/declared.py).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    """One row of the stage table: what the stage reads (recipe paths, upstream files by
    pattern, library versions) and the module whose build(ctx, out) makes its artifact."""
    name: str
    module: str  # dotted, e.g. stages.shards
    params: tuple[str, ...]
    upstream: dict[str, tuple[str, ...]] = field(default_factory=dict)
    packages: tuple[str, ...] = ()
    doc: str = ""
    after: tuple[str, ...] = ()  # actions (doit tasks that store nothing) run before it builds
    runs: tuple[str, ...] = ()  # upstream stages whose run-time measurements (sidecar "run") it reads
    # recipe paths the build may read that do not decide its artifact, kept out of the key: how to
    # reach the world (a node's URL, where the signing key is), or what the first write of a
    # write-once record says (anchor's uri: anchor.json holds what the chain holds)
    settings: tuple[str, ...] = ()
    # upstream stages read only where built for this build (built_for), with the files read of
    # each: the key says which are absent, and nothing waits on them or builds them (the report
    # shows the manifest's anchor where there is one; anchoring needs a chain, reporting does not)
    optional: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # its build records each upstream's key (the receipt does): the keys are part of its key, so
    # an upstream rebuilt to the same bytes under a new key (new code, same output) makes a new
    # record rather than leaving the old keys in it
    records_keys: bool = False
    # modules its build needs that are slow to import: a worker process imports them while training
    # runs, and then builds it (stages/engine/preload.py)
    preload: tuple[str, ...] = ()


def module(stage: Stage):
    """The stage's module (build, and optionally code_modules, extra_inputs, summary, verify, blocked_here),
    imported when first asked for: the engine names no stage, the table does."""
    return importlib.import_module(stage.module)
