"""anchor: the manifest's digest written to a write-once registry on a chain, so anyone can
check the receipt without trusting this machine.

A recipe anchors if its anchor: section pins a registry and its chain id; ops/anchor.yaml pins
the accounts trusted to anchor there (stages/chain/trust.py). Its artifact is anchor.json: where
(chain id, registry), by whom and how (transaction, block, gas) the digest was anchored, as the
chain tells it. Its key is the manifest's digest and the pinned chain and registry, never the
RPC URL, the signing key or the trusted accounts (they decide whether it is built, not what it
says): the registry is write-once, so what it says of a digest is settled by those
alone. A digest already anchored is not sent again; its record is read back, and refused unless
a trusted account anchored it. `doit verify` checks anchor.json against the pins, then the chain.
"""
from __future__ import annotations

import json
from pathlib import Path

from web3.exceptions import ContractCustomError

from stages.chain import node, registry, signer, trust
from stages.engine import jsontext
from stages.engine import verify as receipts
from stages.engine.errors import UserError
from stages.table import STAGES


def extra_inputs(recipe, root, store) -> dict:
    """The pinned chain and registry (the environment may override them for one shell): an
    anchor's identity. Both None for a recipe that does not anchor."""
    return node.where(recipe.anchor)


def build(ctx, out: Path) -> None:
    pinned = ctx.inputs["extra"]
    where = f"registry {pinned['registry']} on chain {pinned['chain_id']}"
    try:
        if pinned["registry"] is None:
            raise UserError(f"recipes/{ctx.recipe_name}.yaml does not anchor: pin a registry and its chain_id in "
                            f"its anchor: section (docs/anchoring.md)")
        w3 = node.open_registry(ctx.recipe.anchor, pinned["chain_id"], pinned["registry"])
        trusted = trust.submitters(ctx.root, **pinned)
        refused = receipts.problems(ctx.recipe_name, False, STAGES)
        if refused:
            raise UserError(f"the manifest does not verify ({refused[0]})")
        digest = bytes.fromhex(ctx.artifacts["manifest"]["digest"])
        anchored = registry.anchoring(w3, pinned["registry"], digest)
        if anchored is None:
            account = signer.account(node.setting(ctx.recipe.anchor, "keystore"))
            if account.address not in trusted:
                raise UserError(f"{account.address} is not trusted to anchor in {where}: add it to that registry's "
                                f"submitters in {trust.FILE}, or sign with an account listed there")
            try:
                registry.anchor(w3, pinned["registry"], account, digest, ctx.recipe.anchor.uri)
            except ContractCustomError as e:  # anchored by someone else since the read above
                if registry.already_anchored(e.data) is None:
                    raise
            anchored = registry.anchoring(w3, pinned["registry"], digest)
            ctx.log.info("anchored %s from %s", digest.hex()[:16], account.address)
        else:
            ctx.log.info("%s was anchored already (block %d); recorded as the chain has it",
                         digest.hex()[:16], anchored["block_number"])
        if anchored["submitter"] not in trusted:
            raise UserError(f"{digest.hex()[:16]} is anchored in {where} already, by {anchored['submitter']}, who is "
                            f"not trusted to anchor there ({trust.FILE}); the registry is write-once, so anchor this "
                            f"manifest in another registry")
    except UserError as e:
        raise UserError(f"anchor:{ctx.recipe_name}: {e}; nothing was anchored") from None
    record = {**pinned, "digest": "0x" + digest.hex(), **anchored}
    (out / "anchor.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def verify(recipe, recipe_name: str, root: Path, artifact: Path | None, digest: str,
           require_anchor: bool) -> tuple[list[str], str | None]:
    """doit verify's anchor check of a recipe that pins a registry, given the manifest's digest
    computed from its bytes: anchor.json must name the pinned chain and registry (not whichever
    it says), this digest and a trusted submitter; then the chain must hold that record. A node
    that cannot be asked leaves the chain unchecked: a note, or a problem with require_anchor.
    Returns (problems, note)."""
    pinned = node.where(recipe.anchor)
    if pinned["registry"] is None:
        return [], None
    if artifact is None:
        return [f"not anchored: run doit anchor:{recipe_name}"], None
    where = f"registry {pinned['registry']} on chain {pinned['chain_id']}"
    trusted = trust.submitters(root, **pinned)
    try:
        anchored = dict(jsontext.read(artifact / "anchor.json"))
    except (ValueError, TypeError):
        return ["anchor.json is not an anchor record"], None
    named = (anchored.get("chain_id"), str(anchored.get("registry")).lower())
    if named != (pinned["chain_id"], pinned["registry"].lower()):
        return [f"anchor.json names registry {anchored.get('registry')} on chain {anchored.get('chain_id')}, not the "
                f"pinned {where} (the recipe's anchor:, or {node.ENV['registry']} and {node.ENV['chain_id']}); "
                f"run doit anchor:{recipe_name}"], None
    if anchored.get("digest") != "0x" + digest:
        return [f"anchor.json anchors {str(anchored.get('digest'))[2:18]}, not this manifest's digest {digest[:16]} "
                f"(built since?); run doit anchor:{recipe_name}"], None
    if anchored.get("submitter") not in trusted:
        return [f"anchored by {anchored.get('submitter')}, who is not trusted to anchor in {where} "
                f"({trust.FILE})"], None
    try:
        w3 = node.open_registry(recipe.anchor, pinned["chain_id"], pinned["registry"])
    except node.NoNode as e:
        if require_anchor:
            return [f"the chain was not checked, and --require-anchor asks for it: {e}"], None
        return [], (f"the chain was not checked: {e}. anchor.json holds this digest in the pinned registry, "
                    f"by {anchored['submitter']} (trusted), block {anchored.get('block_number')}")
    return registry.check(w3, pinned["registry"], anchored, digest, trusted)


def summary(path: Path) -> list[str]:
    """What doit show prints under the anchor stage."""
    a = jsontext.read(path / "anchor.json")
    return [f"chain {a['chain_id']} registry {a['registry']} block {a['block_number']} tx {a['tx_hash']}"]
