"""anchor: the manifest's digest written to a write-once registry on a chain, so anyone can
check the receipt without trusting this machine.

Its artifact is anchor.json: where (chain id, registry) and how (transaction, block, gas) the
digest was anchored, as the chain tells it. Its key is the manifest's digest and the chain and
registry, never the RPC URL or the signing key (settings in the stage table): the registry is
write-once, so what it says of a digest is settled by those alone. A digest already anchored
(by anyone) is not sent again; its record is read back. `doit verify` then re-reads the chain.
"""
from __future__ import annotations

import json
from pathlib import Path

from web3.exceptions import ContractCustomError

from stages.chain import node, registry, signer
from stages.engine import verify as receipts
from stages.engine.errors import UserError


def extra_inputs(recipe, root, store) -> dict:
    """The chain and registry, from the recipe or the environment: an anchor's identity."""
    return node.where(recipe.anchor)


def build(ctx, out: Path) -> None:
    task = f"anchor:{ctx.recipe_name}"
    found = ctx.inputs["extra"]
    try:
        w3 = node.open_registry(ctx.recipe.anchor, found["chain_id"], found["registry"], task)
        refused = receipts.problems(ctx.recipe_name, full=False)
        if refused:
            raise UserError(f"{task}: the manifest does not verify ({refused[0]})")
    except UserError as e:
        raise UserError(f"{e}; nothing was anchored") from None
    digest = bytes.fromhex(ctx.artifacts["manifest"]["digest"])
    anchored = registry.anchoring(w3, found["registry"], digest)
    if anchored is None:
        account = signer.account(node.setting(ctx.recipe.anchor, "keystore"))
        try:
            registry.anchor(w3, found["registry"], account, digest, ctx.recipe.anchor.uri)
        except ContractCustomError as e:  # anchored by someone else since the read above
            if registry.already_anchored(e.data) is None:
                raise
        anchored = registry.anchoring(w3, found["registry"], digest)
        ctx.log.info("anchored %s from %s", digest.hex()[:16], account.address)
    else:
        ctx.log.info("%s was anchored already (block %d); recorded as the chain has it",
                     digest.hex()[:16], anchored["block_number"])
    record = {**found, "digest": "0x" + digest.hex(), **anchored}
    (out / "anchor.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def verify(recipe, artifact: Path, digest: str) -> tuple[list[str], str | None]:
    """doit verify's chain check: the manifest's digest (computed from its bytes) must be the one
    anchored in the registry anchor.json names, by the transaction it names."""
    anchored = json.loads((artifact / "anchor.json").read_text())
    w3 = node.open_registry(recipe.anchor, anchored["chain_id"], anchored["registry"], "cannot read the chain")
    return registry.check(w3, anchored, digest)


def summary(path: Path) -> list[str]:
    """What doit show prints under the anchor stage."""
    a = json.loads((path / "anchor.json").read_text())
    return [f"chain {a['chain_id']} registry {a['registry']} block {a['block_number']} tx {a['tx_hash']}"]
