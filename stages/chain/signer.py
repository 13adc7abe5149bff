"""The account that signs an anchoring transaction: MINDXTRAIN_ANCHOR_KEY, or an encrypted
keystore file (Ethereum's Web3 Secret Storage, as geth and `cast wallet` write it) opened with
MINDXTRAIN_ANCHOR_PASSWORD. Only the environment and that file hold the secret: no message
here prints it, and nothing keeps it."""
from __future__ import annotations

import json
import os
from pathlib import Path

from eth_account import Account
from eth_account.signers.local import LocalAccount

from stages.engine.errors import UserError

KEY, PASSWORD = "MINDXTRAIN_ANCHOR_KEY", "MINDXTRAIN_ANCHOR_PASSWORD"


def account(keystore: str | None) -> LocalAccount:
    """The signing account: the keystore file when one is named, else the key in the environment."""
    if keystore:
        path = Path(keystore).expanduser()
        try:
            encrypted = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"anchor.keystore: cannot read {path} as a JSON keystore ({type(e).__name__}); "
                            f"name an encrypted keystore file") from None
        if PASSWORD not in os.environ:
            raise UserError(f"anchor.keystore: {path} is encrypted; set {PASSWORD} to its password") from None
        try:
            return Account.from_key(Account.decrypt(encrypted, os.environ[PASSWORD]))
        except ValueError:
            raise UserError(f"anchor.keystore: {PASSWORD} does not open {path} (wrong password, or not a "
                            f"keystore); set the right one") from None
    if os.environ.get(KEY):
        try:
            return Account.from_key(os.environ[KEY])
        except Exception:  # the library's message may quote the value: never show it
            raise UserError(f"{KEY} is not a private key (0x and 64 hex digits); set it again "
                            f"(its value is not printed)") from None
    raise UserError(f"no signing key: set {KEY}, or anchor.keystore (or MINDXTRAIN_ANCHOR_KEYSTORE) "
                    f"with {PASSWORD}")
