"""The committed registry contract is what its source and the pinned compiler make, and it is
write-once by construction: two functions, one of them a view; no owner, admin or setter."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from conftest import REPO

CONTRACTS = REPO / "contracts"
COMMITTED = json.loads((CONTRACTS / "AnchorRegistry.json").read_text())
PINNED = json.loads((CONTRACTS / "package.json").read_text())["devDependencies"]["solc"]


def installed_solc() -> str | None:
    package = CONTRACTS / "node_modules" / "solc" / "package.json"
    return json.loads(package.read_text())["version"] if package.is_file() else None


@pytest.mark.skipif(shutil.which("node") is None or installed_solc() != PINNED,
                    reason=f"needs node and solc {PINNED} in contracts/node_modules (npm ci --prefix contracts; "
                           f".ci/run does it)")
def test_recompiling_gives_the_committed_abi_and_bytecode(tmp_path):
    out = tmp_path / "AnchorRegistry.json"
    run = subprocess.run(["node", str(CONTRACTS / "compile.mjs"), str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    fresh = json.loads(out.read_text())
    assert fresh["compiler"] == COMMITTED["compiler"] and fresh["compiler"]["version"].startswith(PINNED + "+")
    assert fresh["settings"] == COMMITTED["settings"]
    assert fresh["bytecode"] == COMMITTED["bytecode"]
    assert fresh["deployedBytecode"] == COMMITTED["deployedBytecode"]
    assert fresh["abi"] == COMMITTED["abi"]


def test_the_settings_pin_a_fork_py_evm_runs():
    # solc 0.8.37 targets osaka unless told; py-evm 0.12 (eth-tester's EVM) stops at prague
    from eth.vm.forks import PragueVM

    assert COMMITTED["settings"]["evmVersion"] == "prague" and PragueVM.fork == "prague"


def test_the_registry_has_no_owner_admin_or_setter():
    functions = {e["name"]: e for e in COMMITTED["abi"] if e["type"] == "function"}
    assert set(functions) == {"anchor", "record"}
    assert functions["record"]["stateMutability"] == "view"
    assert [i["type"] for i in functions["anchor"]["inputs"]] == ["bytes32", "string"]
    assert functions["anchor"]["stateMutability"] == "nonpayable"
    assert not [e for e in COMMITTED["abi"] if e["type"] in ("constructor", "fallback", "receive")]
    event = next(e for e in COMMITTED["abi"] if e["type"] == "event")
    assert event["name"] == "Anchored"
    assert [(i["name"], i["indexed"]) for i in event["inputs"]] == [("digest", True), ("submitter", True), ("uri", False)]
    source = (CONTRACTS / "AnchorRegistry.sol").read_text()
    assert "delegatecall" not in source and "selfdestruct" not in source
