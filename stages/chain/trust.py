"""Who may anchor: ops/anchor.yaml lists, for each registry a recipe anchors in (its chain id and
address), the accounts trusted to anchor receipts in it. The registry is write-once but open to
all: anyone can anchor any digest, so an anchor vouches for a manifest only if its submitter is
on this list. The file is committed and not secret (addresses, never keys), like the recipe's
pins; MINDXTRAIN_ANCHOR_SUBMITTERS (addresses, comma-separated) replaces its list for one shell.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from web3 import Web3

from stages.engine.errors import UserError
from stages.engine.recipe import UNBUILDABLE

FILE = Path("ops") / "anchor.yaml"
ENV = "MINDXTRAIN_ANCHOR_SUBMITTERS"
HEX = re.compile(r"0x[0-9a-fA-F]{40}")
MAX_BYTES, MAX_DEPTH = 1 << 16, 8  # a page of addresses; registries > entry > submitters is 4 deep


def address(value, where: str) -> str:
    """The checksummed form of an address (0x and 40 hex digits: all one case, or mixed as its
    checksum says), or one line naming where the bad one is."""
    digits = value[2:] if isinstance(value, str) and HEX.fullmatch(value) else None
    if digits is None or (digits not in (digits.lower(), digits.upper()) and not Web3.is_checksum_address(value)):
        raise UserError(f"{where}: {value!r} is not an address (0x and 40 hex digits, with a valid checksum if "
                        f"mixed-case); fix it")
    return Web3.to_checksum_address(value)


def read(root: Path) -> list[dict]:
    """ops/anchor.yaml's entries, each checked: chain_id (a whole number), registry (an address),
    submitters (one address or more). Bounded before it is parsed: a page, no aliases, 8 deep."""
    path = root / FILE
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{FILE} is missing: it pins the accounts trusted to anchor (docs/anchoring.md); "
                        f"create it") from None
    if len(data) > MAX_BYTES:
        raise UserError(f"{FILE}: over {MAX_BYTES >> 10} KiB; it lists registries and addresses, nothing else")
    try:
        depth = 0
        for event in yaml.parse(data):
            if isinstance(event, yaml.AliasEvent):
                raise UserError(f"{FILE}:{event.start_mark.line + 1}: write the addresses out (no YAML aliases)")
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > MAX_DEPTH:
                raise UserError(f"{FILE}:{event.start_mark.line + 1}: nested deeper than a list of registries needs")
        found = yaml.safe_load(data)
    except yaml.YAMLError as e:
        line = f":{e.problem_mark.line + 1}" if getattr(e, "problem_mark", None) else ""
        raise UserError(f"{FILE}{line}: not valid YAML; fix it") from None
    except UNBUILDABLE as e:  # a value YAML cannot build: 2001-02-30, !!bool foo
        raise UserError(f"{FILE}: YAML cannot build a value ({str(e).split(';')[0]}); fix it") from None
    entries = found.get("registries") if isinstance(found, dict) and set(found) == {"registries"} else None
    if not isinstance(entries, list):
        raise UserError(f"{FILE}: give one key, registries: a list of entries with chain_id, registry and submitters")
    checked = []
    for i, entry in enumerate(entries):
        where = f"{FILE}: registries[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"chain_id", "registry", "submitters"}:
            raise UserError(f"{where}: give exactly chain_id, registry and submitters")
        if type(entry["chain_id"]) is not int or entry["chain_id"] <= 0:
            raise UserError(f"{where}.chain_id: {entry['chain_id']!r} is not a chain id (a whole number); fix it")
        if not isinstance(entry["submitters"], list) or not entry["submitters"]:
            raise UserError(f"{where}.submitters: give a list of one address or more")
        checked.append({"chain_id": entry["chain_id"], "registry": address(entry["registry"], f"{where}.registry"),
                        "submitters": [address(a, f"{where}.submitters[{j}]")
                                       for j, a in enumerate(entry["submitters"])]})
    return checked


def submitters(root: Path, chain_id: int, registry: str) -> list[str]:
    """The accounts (checksummed) trusted to anchor in `registry` on chain `chain_id`."""
    if os.environ.get(ENV):
        return [address(a.strip(), ENV) for a in os.environ[ENV].split(",")]
    entries = [e for e in read(root) if (e["chain_id"], e["registry"]) == (chain_id, registry)]
    if len(entries) != 1:
        raise UserError(f"{FILE}: {'no entry' if not entries else 'more than one entry'} for registry {registry} "
                        f"on chain {chain_id}; {'add one' if not entries else 'keep one'} listing the accounts "
                        f"trusted to anchor in it (docs/anchoring.md)")
    return entries[0]["submitters"]
