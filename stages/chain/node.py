"""Where the registry is: its address and chain id, pinned in the recipe's anchor: section (a
recipe that names no registry is not anchored), and the RPC URL, from the recipe or the
environment; for one shell the environment overrides each. And a connection to the node that
refuses a node on another chain. A URL may carry a provider's token in its path, so messages
name only its scheme, host and port."""
from __future__ import annotations

import os
from urllib.parse import urlsplit

from web3 import Web3

from stages.chain import registry, trust
from stages.engine.errors import UserError

ENV = {"rpc_url": "MINDXTRAIN_ANCHOR_RPC_URL", "registry": "MINDXTRAIN_ANCHOR_REGISTRY",
       "chain_id": "MINDXTRAIN_ANCHOR_CHAIN_ID", "keystore": "MINDXTRAIN_ANCHOR_KEYSTORE"}


class NoNode(UserError):
    """No node to ask: none configured, or none answering. doit verify checks all the rest and
    says the chain was not checked (a failure with --require-anchor)."""


def setting(section, name: str):
    """The environment's value for this shell, else the recipe's anchor.<name> (None if neither)."""
    value = os.environ.get(ENV[name]) or getattr(section, name)
    return value if value not in (None, "") else None


def where(section) -> dict:
    """The pinned registry's address (checksummed) and chain id: what an anchor's identity is
    made of beside the manifest's digest. Both None for a recipe that names no registry: it is
    not anchored, whatever the environment says."""
    if section.registry is None:
        return {"chain_id": None, "registry": None}
    registry = trust.address(setting(section, "registry"), f"anchor.registry (or {ENV['registry']})")
    chain_id = setting(section, "chain_id")
    if not str(chain_id).isdigit() or int(chain_id) == 0:
        raise UserError(f"{ENV['chain_id']}: {chain_id!r} is not a chain id (a whole number above 0)")
    return {"chain_id": int(chain_id), "registry": registry}


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
        raise NoNode(f"cannot reach the JSON-RPC node at {shown(rpc_url)} ({type(e).__name__}); start it "
                     f"or fix anchor.rpc_url") from None
    if found != chain_id:
        raise UserError(f"the node at {shown(rpc_url)} is on chain {found}, not anchor.chain_id {chain_id}; "
                        f"point anchor.rpc_url at chain {chain_id} or change anchor.chain_id")
    return w3


def open_registry(section, chain_id: int, address: str) -> Web3:
    """A connection to the pinned chain, the registry's code checked; NoNode if no RPC is
    configured or the node does not answer (nothing is contacted, nothing changes)."""
    rpc_url = setting(section, "rpc_url")
    if rpc_url is None:
        raise NoNode(f"no RPC configured (anchor.rpc_url in the recipe, or {ENV['rpc_url']})")
    w3 = connect(rpc_url, chain_id)
    registry.check_code(w3, address)
    return w3
