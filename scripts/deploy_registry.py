"""Deploy a new AnchorRegistry (the committed bytecode of contracts/AnchorRegistry.json) and print
its address and chain id, the two values a recipe's anchor: section and ops/anchor.yaml pin
(docs/anchoring.md). It signs as `doit anchor` does: MINDXTRAIN_ANCHOR_KEY, or the keystore file
MINDXTRAIN_ANCHOR_KEYSTORE names with its password in MINDXTRAIN_ANCHOR_PASSWORD.

    MINDXTRAIN_ANCHOR_KEY=0x... python scripts/deploy_registry.py http://127.0.0.1:8545
"""
import argparse
import os
import sys

from web3 import Web3

from stages.chain import node, registry, signer
from stages.engine.errors import UserError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rpc_url", help="the chain's JSON-RPC endpoint, e.g. http://127.0.0.1:8545 (anvil)")
    rpc_url = parser.parse_args().rpc_url
    try:
        account = signer.account(os.environ.get(node.ENV["keystore"]))
        w3 = Web3(Web3.HTTPProvider(rpc_url, request_kwargs={"timeout": 60}))
        if not w3.is_connected():
            raise UserError(f"cannot reach the JSON-RPC node at {node.shown(rpc_url)}; start it or fix the URL")
        address = registry.deploy(w3, account)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"registry {address} on chain {w3.eth.chain_id}, deployed from {account.address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
