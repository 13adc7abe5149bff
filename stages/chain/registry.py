"""The registry contract (contracts/AnchorRegistry.sol) through web3.py: deploy it, anchor a
digest, read a record, and find the transaction that anchored it. The ABI and bytecode are the
committed contracts/AnchorRegistry.json, which tests/test_registry.py recompiles and compares."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from eth_abi import decode
from web3 import Web3

from stages.engine.errors import UserError

ARTIFACT = Path(__file__).resolve().parents[2] / "contracts" / "AnchorRegistry.json"


@functools.cache
def compiled() -> dict:
    return json.loads(ARTIFACT.read_text())


def contract(w3: Web3, address: str):
    return w3.eth.contract(address=Web3.to_checksum_address(address), abi=compiled()["abi"])


def check_code(w3: Web3, address: str) -> None:
    """Refuse an address whose code is not this registry's: a registry with an owner, a setter or
    a proxy could rewrite what it says, so the write-once promise rests on the exact code."""
    if w3.eth.get_code(Web3.to_checksum_address(address)).to_0x_hex() != compiled()["deployedBytecode"]:
        raise UserError(f"anchor.registry: {address} on chain {w3.eth.chain_id} is not an AnchorRegistry "
                        f"(its code is not contracts/AnchorRegistry.json's); name the registry's address")


def send(w3: Web3, account, tx: dict) -> dict:
    """Sign with the local account, send, and wait for the receipt; a failed one is an error."""
    tx = {**tx, "from": account.address, "chainId": w3.eth.chain_id,
          "nonce": w3.eth.get_transaction_count(account.address, "pending")}
    sent = w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction)
    receipt = w3.eth.wait_for_transaction_receipt(sent, timeout=300)
    if receipt["status"] != 1:
        raise UserError(f"transaction {sent.to_0x_hex()} failed on chain {w3.eth.chain_id}")
    return receipt


def deploy(w3: Web3, account) -> str:
    """Deploy a new registry from `account`; returns its address."""
    factory = w3.eth.contract(abi=compiled()["abi"], bytecode=compiled()["bytecode"])
    return send(w3, account, factory.constructor().build_transaction({"from": account.address}))["contractAddress"]


def anchor(w3: Web3, address: str, account, digest: bytes, uri: str) -> dict:
    """Anchor `digest` from `account`; returns the receipt. The node's gas estimate runs the call
    first, so over JSON-RPC an anchored digest raises ContractCustomError (already_anchored
    decodes its data) and nothing is sent."""
    fn = contract(w3, address).functions.anchor(digest, uri)
    return send(w3, account, fn.build_transaction({"from": account.address}))


def already_anchored(revert: bytes | str) -> dict | None:
    """The arguments (digest, submitter, timestamp) of an AlreadyAnchored revert, from its revert
    data (bytes, or hex as a node's error carries it: ContractCustomError.data), or None if the
    revert is another one."""
    spec = next(e for e in compiled()["abi"] if e["type"] == "error" and e["name"] == "AlreadyAnchored")
    types = [i["type"] for i in spec["inputs"]]
    data = bytes.fromhex(revert.removeprefix("0x")) if isinstance(revert, str) else bytes(revert)
    if data[:4] != Web3.keccak(text=f"AlreadyAnchored({','.join(types)})")[:4]:
        return None
    found = dict(zip([i["name"] for i in spec["inputs"]], decode(types, data[4:])))
    return {**found, "submitter": Web3.to_checksum_address(found["submitter"])}


def record(w3: Web3, address: str, digest: bytes) -> dict | None:
    """What the registry holds for `digest` (None if never anchored), read by a plain call."""
    submitter, timestamp, block, uri = contract(w3, address).functions.record(digest).call()
    return None if timestamp == 0 else {"submitter": submitter, "timestamp": timestamp, "block_number": block,
                                        "uri": uri}


def anchoring(w3: Web3, address: str, digest: bytes) -> dict | None:
    """The anchoring of `digest` as the chain tells it: its record, and the transaction (hash,
    gas used) found by its Anchored event in the record's block. None if never anchored."""
    found = record(w3, address, digest)
    if found is None:
        return None
    events = contract(w3, address).events.Anchored.get_logs(
        argument_filters={"digest": digest}, from_block=found["block_number"], to_block=found["block_number"])
    tx = events[0]["transactionHash"]
    return {**found, "tx_hash": tx.to_0x_hex(), "gas_used": w3.eth.get_transaction_receipt(tx)["gasUsed"]}


def check(w3: Web3, address: str, anchored: dict, digest: str, trusted: list[str]) -> tuple[list[str], str | None]:
    """The chain's word on a manifest whose digest (hex, computed from its bytes) anchor.json says
    is anchored in the pinned registry `address`: (problems, a note saying where and by whom). The
    record must be the chain's, and its submitter one of `trusted`: anyone can anchor a digest."""
    where = f"registry {address} on chain {w3.eth.chain_id}"
    on_chain = anchoring(w3, address, bytes.fromhex(digest))
    if on_chain is None:
        return [f"this manifest's digest {digest[:16]} is not anchored in {where}, though anchor.json says it is "
                f"(tx {anchored.get('tx_hash')})"], None
    if on_chain["submitter"] not in trusted:
        return [f"{digest[:16]} was anchored in {where} by {on_chain['submitter']}, who is not trusted to anchor "
                f"there (ops/anchor.yaml)"], None
    if any(on_chain[k] != anchored.get(k) for k in on_chain):
        return [f"the chain's record of {digest[:16]} in {where} (tx {on_chain['tx_hash']}) is not the one "
                f"anchor.json holds (tx {anchored.get('tx_hash')})"], None
    return [], (f"anchored in {where} by {on_chain['submitter']} (trusted), block {on_chain['block_number']} "
                f"(tx {on_chain['tx_hash']})")
