"""Where the registry is: the RPC URL, the registry's address and the chain id, each from the
recipe's anchor: section or else the environment; and a connection to the node that refuses a
node on another chain. A URL may carry a provider's token in its path, so messages name only
its scheme, host and port."""
from __future__ import annotations

import os
from urllib.parse import urlsplit

from web3 import Web3

from stages.chain import registry
from stages.engine.errors import UserError

ENV = {"rpc_url": "MINDXTRAIN_ANCHOR_RPC_URL", "registry": "MINDXTRAIN_ANCHOR_REGISTRY",
       "chain_id": "MINDXTRAIN_ANCHOR_CHAIN_ID", "keystore": "MINDXTRAIN_ANCHOR_KEYSTORE"}


def setting(section, name: str):
    """The recipe's anchor.<name>, else the environment's (None if neither gives one)."""
    value = getattr(section, name)
    return value if value not in (None, "") else os.environ.get(ENV[name]) or None


def where(section) -> dict:
    """The registry's address (checksummed) and chain id, as far as they are given: what an
    anchor's identity is made of beside the manifest's digest."""
    registry, chain_id = setting(section, "registry"), setting(section, "chain_id")
    if registry is not None:
        if not Web3.is_address(registry):
            raise UserError(f"anchor.registry (or {ENV['registry']}): {registry!r} is not an address "
                            f"(0x and 40 hex digits, with a valid checksum if mixed-case)")
        registry = Web3.to_checksum_address(registry)
    if chain_id is not None:
        try:
            chain_id = int(chain_id)
        except ValueError:
            raise UserError(f"{ENV['chain_id']}: {chain_id!r} is not a chain id (a whole number)") from None
    return {"chain_id": chain_id, "registry": registry}


def shown(url: str) -> str:
    """A URL as messages may show it: scheme, host and port only."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def connect(rpc_url: str, chain_id: int) -> Web3:
    """A web3 connection over HTTP to the node at rpc_url, which must be on chain_id."""
    if urlsplit(rpc_url).scheme not in ("http", "https"):
        raise UserError(f"anchor.rpc_url (or {ENV['rpc_url']}): give an http:// or https:// JSON-RPC URL")
    w3 = Web3(Web3.HTTPProvider(rpc_url, request_kwargs={"timeout": 60}))
    try:
        found = w3.eth.chain_id
    except Exception as e:
        raise UserError(f"cannot reach the JSON-RPC node at {shown(rpc_url)} ({type(e).__name__}); start it "
                        f"or fix anchor.rpc_url") from None
    if found != chain_id:
        raise UserError(f"the node at {shown(rpc_url)} is on chain {found}, not anchor.chain_id {chain_id}; "
                        f"point anchor.rpc_url at chain {chain_id} or change anchor.chain_id")
    return w3


def open_registry(section, chain_id, address, task: str) -> Web3:
    """A connection to the registry's chain, the registry's code checked; or one line saying
    what is missing (no RPC configured: nothing is contacted, nothing changes)."""
    rpc_url = setting(section, "rpc_url")
    if rpc_url is None:
        raise UserError(f"{task}: no RPC configured (anchor.rpc_url in the recipe, or {ENV['rpc_url']})")
    for name, value in (("chain_id", chain_id), ("registry", address)):
        if value is None:
            raise UserError(f"{task}: anchor.{name} is not set (in the recipe, or {ENV[name]})")
    w3 = connect(rpc_url, chain_id)
    registry.check_code(w3, address)
    return w3
