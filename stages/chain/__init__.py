"""The anchor stage's internals: the registry contract through web3.py (registry), the signing
account (signer), and where the chain is (node)."""
