"""Anchoring a receipt on a chain: the registry contract on eth-tester's EVM (py-evm) through
web3's EthereumTesterProvider, and `doit anchor` / `doit verify` through web3's HTTP provider
against a real JSON-RPC node (anvil, pinned in contracts/package.json) on 127.0.0.1."""
from __future__ import annotations

import html
import json
import re
import socket
import stat
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import blake3
import pytest
from eth.exceptions import Revert
from eth_account import Account
from eth_tester import EthereumTester
from eth_tester.backends.pyevm.main import get_default_account_keys
from eth_tester.exceptions import TransactionFailed
from web3 import EthereumTesterProvider, Web3
from web3.exceptions import ContractCustomError

from conftest import REPO, doit, snapshot
from stages.chain import registry, signer
from stages.engine.errors import UserError
from stages.engine.store import hash_file, merkle

ANVIL = REPO / "contracts" / "node_modules" / ".bin" / "anvil"


@pytest.fixture
def chain():
    """A fresh eth-tester chain, its web3, and two funded local accounts."""
    tester = EthereumTester()
    first, second = (Account.from_key(k.to_bytes()) for k in get_default_account_keys()[:2])
    return tester, Web3(EthereumTesterProvider(tester)), first, second


def manifest_digest(project: Path) -> str:
    """The manifest artifact's digest from its bytes, as a person would compute it: BLAKE3 over
    the line 'manifest.json NUL <BLAKE3 of the file> LF' (the store's Merkle digest of one file)."""
    key = json.loads((project / "artifacts" / "tiny" / "manifest.json").read_text())["key"]
    file = project / "artifacts" / "store" / "manifest" / key / "manifest.json"
    return blake3.blake3(f"manifest.json\0{blake3.blake3(file.read_bytes()).hexdigest()}\n".encode()).hexdigest()


def test_deploy_anchor_and_another_account_reads_the_record_and_events(chain):
    _, w3, first, second = chain
    address = registry.deploy(w3, first)
    registry.check_code(w3, address)  # the deployed code is the committed runtime bytecode
    digest = blake3.blake3(b"a manifest").digest()
    assert registry.record(w3, address, digest) is None
    receipt = registry.anchor(w3, address, first, digest, "s3://bucket/tiny")
    assert receipt["status"] == 1

    (event,) = registry.contract(w3, address).events.Anchored().process_receipt(receipt)
    assert event["args"]["digest"] == digest and event["args"]["submitter"] == first.address
    assert event["args"]["uri"] == "s3://bucket/tiny"

    # another account, which anchored nothing, reads the record with a plain call
    reader = w3.eth.contract(address=address, abi=registry.compiled()["abi"])
    submitter, timestamp, block, uri = reader.functions.record(digest).call({"from": second.address})
    assert (submitter, block, uri) == (first.address, receipt["blockNumber"], "s3://bucket/tiny")
    assert timestamp == w3.eth.get_block(receipt["blockNumber"])["timestamp"]
    found = registry.anchoring(w3, address, digest)
    assert found["tx_hash"] == receipt["transactionHash"].to_0x_hex() and found["gas_used"] == receipt["gasUsed"]


def test_a_second_anchor_of_the_same_digest_reverts_with_AlreadyAnchored(chain):
    tester, w3, first, second = chain
    address = registry.deploy(w3, first)
    digest = blake3.blake3(b"a manifest").digest()
    registry.anchor(w3, address, first, digest, "first")
    first_record, height = registry.record(w3, address, digest), w3.eth.block_number

    # through web3, the gas estimate runs the call first: it reverts and nothing is sent
    with pytest.raises(TransactionFailed, match="execution reverted"):
        registry.anchor(w3, address, second, digest, "second")
    assert w3.eth.block_number == height and w3.eth.get_transaction_count(second.address) == 0

    # the revert is the contract's custom error, with its arguments (eth-tester's own call turns
    # custom-error data into text, so the signed transaction is run on its py-evm chain directly;
    # a legacy one, as py-evm's costless execution reads a gas price)
    fn = registry.contract(w3, address).functions.anchor(digest, "second")
    tx = fn.build_transaction({"from": second.address, "gas": 200_000, "gasPrice": w3.eth.gas_price, "nonce": 0,
                               "chainId": w3.eth.chain_id})
    evm = tester.backend.chain
    signed = evm.get_vm().get_transaction_builder().decode(second.sign_transaction(tx).raw_transaction)
    with pytest.raises(Revert) as revert:
        evm.get_transaction_result(signed, evm.get_canonical_head())
    assert registry.already_anchored(revert.value.args[0]) == {
        "digest": digest, "submitter": first.address, "timestamp": first_record["timestamp"]}
    assert registry.already_anchored(b"\x08\xc3\x79\xa0" + bytes(64)) is None  # Error(string) is another

    # sent anyway (its gas given, so no estimate stops it), it is mined and fails; the record stands
    with pytest.raises(UserError, match="failed on chain"):
        registry.send(w3, second, tx)
    assert registry.record(w3, address, digest) == first_record


def test_an_address_that_is_not_the_registry_is_refused(chain):
    _, w3, first, second = chain
    with pytest.raises(UserError, match="is not an AnchorRegistry"):
        registry.check_code(w3, second.address)


def test_a_tampered_manifest_fails_the_chain_check(chain, warm):
    _, w3, first, _ = chain
    address, digest = registry.deploy(w3, first), manifest_digest(warm)
    registry.anchor(w3, address, first, bytes.fromhex(digest), "")
    anchored = {"chain_id": w3.eth.chain_id, "registry": address, "digest": "0x" + digest,
                **registry.anchoring(w3, address, bytes.fromhex(digest))}
    assert registry.check(w3, anchored, digest)[0] == []

    key = json.loads((warm / "artifacts" / "tiny" / "manifest.json").read_text())["key"]
    file = warm / "artifacts" / "store" / "manifest" / key / "manifest.json"
    file.chmod(stat.S_IWUSR | stat.S_IRUSR)
    file.write_text(file.read_text().replace('"lr": 0.005', '"lr": 0.004'))
    problems, _ = registry.check(w3, anchored, manifest_digest(warm))
    assert len(problems) == 1 and "is not anchored in registry" in problems[0], problems


def test_the_signing_key_comes_from_an_encrypted_keystore_or_the_environment(tmp_path, monkeypatch):
    account = Account.create()
    keystore = tmp_path / "key.json"
    keystore.write_text(json.dumps(Account.encrypt(account.key, "pass phrase", kdf="pbkdf2", iterations=1000)))
    monkeypatch.delenv(signer.KEY, raising=False)
    monkeypatch.delenv(signer.PASSWORD, raising=False)
    with pytest.raises(UserError, match="no signing key"):
        signer.account(None)
    with pytest.raises(UserError, match="set MINDXTRAIN_ANCHOR_PASSWORD"):
        signer.account(str(keystore))
    monkeypatch.setenv(signer.PASSWORD, "wrong")
    with pytest.raises(UserError, match="does not open"):
        signer.account(str(keystore))
    monkeypatch.setenv(signer.PASSWORD, "pass phrase")
    assert signer.account(str(keystore)).address == account.address
    monkeypatch.setenv(signer.KEY, account.key.hex()[:-2] + "zz")
    with pytest.raises(UserError) as bad:
        signer.account(None)
    assert account.key.hex()[:-2] not in str(bad.value) and "not printed" in str(bad.value)


def test_with_no_rpc_configured_anchor_says_so_and_changes_nothing(warm):
    before = snapshot(warm)
    env = {name: "" for name in ("MINDXTRAIN_ANCHOR_RPC_URL", "MINDXTRAIN_ANCHOR_REGISTRY", "MINDXTRAIN_ANCHOR_CHAIN_ID")}
    run = doit(warm, "anchor:tiny", env=env)
    assert run.rc != 0
    errors = [line for line in run.out.splitlines() if line.startswith("error:")]
    assert errors == ["error: anchor:tiny: no RPC configured (anchor.rpc_url in the recipe, or "
                      "MINDXTRAIN_ANCHOR_RPC_URL); nothing was anchored"], run.out
    assert "Traceback" not in run.out and snapshot(warm) == before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def anvil(tmp_path, monkeypatch):
    """A local JSON-RPC node on 127.0.0.1 (chain 31337, prague), its URL and funded dev keys."""
    if not ANVIL.exists():
        pytest.skip("needs anvil in contracts/node_modules (npm ci --prefix contracts; .ci/run does it)")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    port, config = free_port(), tmp_path / "anvil.json"
    node = subprocess.Popen([str(ANVIL), "--host", "127.0.0.1", "--port", str(port), "--chain-id", "31337",
                             "--hardfork", "prague", "--config-out", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while not (config.exists() and Web3(Web3.HTTPProvider(url)).is_connected()):
            assert node.poll() is None and time.time() < deadline, "anvil did not start"
            time.sleep(0.2)
        yield url, json.loads(config.read_text())["private_keys"]
    finally:
        node.terminate()
        node.wait(timeout=30)


def test_anchor_and_verify_through_a_json_rpc_node(warm, anvil):
    url, keys = anvil
    w3 = Web3(Web3.HTTPProvider(url))
    deployer, submitter = Account.from_key(keys[0]), Account.from_key(keys[1])
    address = registry.deploy(w3, deployer)
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text() + f"\nanchor:\n  rpc_url: {url}\n  uri: s3://models/tiny\n")
    env = {"MINDXTRAIN_ANCHOR_REGISTRY": address.lower(), "MINDXTRAIN_ANCHOR_CHAIN_ID": "31337",
           "MINDXTRAIN_ANCHOR_KEY": keys[1],
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    run = doit(warm, "anchor:tiny", env=env)
    assert run.rc == 0, run.out[-3000:]
    assert run.stages_ran() == {"manifest", "anchor"}  # the recipe changed: same manifest bytes
    anchored = json.loads((warm / "artifacts" / "tiny" / "latest" / "anchor" / "anchor.json").read_text())
    digest = manifest_digest(warm)
    receipt = w3.eth.get_transaction_receipt(anchored["tx_hash"])
    assert anchored == {"chain_id": 31337, "registry": address, "digest": "0x" + digest,
                        "tx_hash": receipt["transactionHash"].to_0x_hex(), "block_number": receipt["blockNumber"],
                        "gas_used": receipt["gasUsed"], "submitter": submitter.address,
                        "timestamp": w3.eth.get_block(receipt["blockNumber"])["timestamp"], "uri": "s3://models/tiny"}
    assert registry.record(w3, address, bytes.fromhex(digest))["submitter"] == submitter.address
    secret = keys[1].removeprefix("0x").lower()
    assert secret not in run.out.lower()
    for path in (warm / "artifacts").rglob("*"):  # not in an artifact, a sidecar, a log or a pointer
        assert not path.is_file() or secret.encode() not in path.read_bytes().lower(), path

    # the same digest, chain and registry: up to date, whatever the URL; nothing is sent
    height = w3.eth.block_number
    run = doit(warm, "anchor:tiny", env={**env, "MINDXTRAIN_ANCHOR_KEY": ""})
    assert run.rc == 0 and run.ran == [], run.out[-2000:]
    recipe.write_text(recipe.read_text().replace(url, url.replace("127.0.0.1", "localhost")))
    run = doit(warm, "anchor:tiny", env=env)
    assert run.rc == 0 and "anchor" not in run.stages_ran() and w3.eth.block_number == height, run.out[-2000:]

    # a node on another chain, or an address that is not this registry: refused, nothing changes
    before = snapshot(warm)
    run = doit(warm, "anchor:tiny", env={**env, "MINDXTRAIN_ANCHOR_CHAIN_ID": "1"})
    assert run.rc != 0 and "is on chain 31337, not anchor.chain_id 1" in run.out, run.out[-2000:]
    run = doit(warm, "anchor:tiny", env={**env, "MINDXTRAIN_ANCHOR_REGISTRY": deployer.address})
    assert run.rc != 0 and f"{deployer.address} on chain 31337 is not an AnchorRegistry" in run.out, run.out[-2000:]
    assert "nothing was anchored" in run.out and snapshot(warm) == before and w3.eth.block_number == height

    # anchoring the same digest again is refused by the contract itself, with its custom error
    with pytest.raises(ContractCustomError) as again:
        registry.anchor(w3, address, deployer, bytes.fromhex(digest), "another")
    assert registry.already_anchored(again.value.data)["submitter"] == submitter.address

    run = doit(warm, "verify:tiny", env=env)
    assert run.rc == 0 and f"anchor: anchored in registry {address} on chain 31337" in run.out, run.out[-2000:]

    # a forged manifest: its bytes and the store's record of them changed together, so the store
    # checks pass; the chain does not hold its digest
    key = json.loads((warm / "artifacts" / "tiny" / "manifest.json").read_text())["key"]
    obj = warm / "artifacts" / "store" / "manifest" / key
    (obj / "manifest.json").chmod(stat.S_IWUSR | stat.S_IRUSR)
    (obj / "manifest.json").write_text((obj / "manifest.json").read_text().replace('"lr": 0.005', '"lr": 0.004'))
    sidecar = obj.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    meta["files"]["manifest.json"] = blake3.blake3((obj / "manifest.json").read_bytes()).hexdigest()
    meta["digest"] = manifest_digest(warm)
    sidecar.chmod(stat.S_IWUSR | stat.S_IRUSR)
    sidecar.write_text(json.dumps(meta))
    run = doit(warm, "verify:tiny", env=env)
    assert run.rc != 0, run.out[-2000:]
    failed = [line for line in run.out.splitlines() if line.startswith(("error:", "verify:"))]
    assert failed == [f"error: verify: tiny: anchor: this manifest's digest {meta['digest'][:16]} is not anchored in "
                      f"registry {address} on chain 31337 (anchor.json says {digest[:16]} was, in "
                      f"{anchored['tx_hash']}); if you rebuilt it, run doit anchor"], run.out[-2000:]


def report_text(project: Path) -> str:
    """The text of the recipe's report.html, tags dropped and entities decoded."""
    page = (project / "artifacts" / "tiny" / "latest" / "report" / "report.html").read_text()
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", page)))


def report_inputs(project: Path) -> tuple[str, dict]:
    """The report's key and what it was computed from (its sidecar's inputs)."""
    key = json.loads((project / "artifacts" / "tiny" / "report.json").read_text())["key"]
    return key, json.loads((project / "artifacts" / "store" / "report" / f"{key}.json").read_text())["inputs"]


def test_the_report_shows_the_anchor_of_its_own_manifest_only(warm, anvil):
    url, keys = anvil
    w3 = Web3(Web3.HTTPProvider(url))
    address = registry.deploy(w3, Account.from_key(keys[0]))
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text() + f"\nanchor:\n  rpc_url: {url}\n")
    chain = {"MINDXTRAIN_ANCHOR_REGISTRY": address, "MINDXTRAIN_ANCHOR_CHAIN_ID": "31337",
             "MINDXTRAIN_ANCHOR_KEY": keys[1], "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}

    # the report neither builds the anchor nor reads the chain (builds here reach no network)
    run = doit(warm, "report:tiny")
    assert run.rc == 0 and run.stages_ran() == {"manifest", "report"}, run.out[-3000:]
    assert " not anchored " in report_text(warm)
    before_key, before = report_inputs(warm)
    assert before["optional"] == {"anchor": None}

    run = doit(warm, "anchor:tiny", env=chain)
    assert run.rc == 0 and run.stages_ran() == {"anchor"}, run.out[-3000:]
    status = doit(warm, "status:tiny", env=chain)
    assert status.rc == 0 and "  report     stale: anchor now built\n" in status.out, status.out

    # anchored: the report is stale, rebuilds (still without the chain) and shows the anchor
    run = doit(warm, "report:tiny")
    assert run.rc == 0 and run.stages_ran() == {"report"}, run.out[-3000:]
    anchor_json = warm / "artifacts" / "tiny" / "latest" / "anchor" / "anchor.json"
    anchored = json.loads(anchor_json.read_text())
    when = datetime.fromtimestamp(w3.eth.get_block(anchored["block_number"])["timestamp"], timezone.utc)
    assert (f"anchored on chain 31337 in registry {address} by transaction {anchored['tx_hash']}, "
            f"block {anchored['block_number']} ({when:%Y-%m-%d %H:%M:%S} UTC)") in report_text(warm)
    assert "not anchored" not in report_text(warm)
    key, inputs = report_inputs(warm)
    assert key != before_key and {**inputs, "optional": None} == {**before, "optional": None}
    # the key covers the declared file of the anchor, and only it
    assert inputs["optional"] == {"anchor": merkle({"anchor.json": hash_file(anchor_json)})}
    assert doit(warm, "report:tiny").ran == []

    # an anchor.json changed in the store is not shown: the report is the unanchored one again
    # (from the store), and with the file put back, the anchored one
    written = anchor_json.read_text()
    anchor_json.chmod(stat.S_IWUSR | stat.S_IRUSR)
    anchor_json.write_text(written.replace(anchored["tx_hash"], "0x" + "00" * 32))
    assert doit(warm, "report:tiny").rc == 0 and report_inputs(warm)[0] == before_key
    assert " not anchored " in report_text(warm)
    anchor_json.write_text(written)
    assert doit(warm, "report:tiny").rc == 0 and report_inputs(warm)[0] == key
    assert anchored["tx_hash"] in report_text(warm)

    # a new manifest: the anchor of the old one is not this build's, and is not shown
    recipe.write_text(recipe.read_text() + "checks:\n  max_epochs: 9\n")  # in the manifest, read by no stage
    run = doit(warm, "report:tiny")
    assert run.rc == 0 and run.stages_ran() == {"manifest", "report"}, run.out[-3000:]
    assert json.loads(anchor_json.read_text()) == anchored  # still there, of the old manifest
    assert " not anchored " in report_text(warm) and anchored["tx_hash"] not in report_text(warm)
    assert report_inputs(warm)[1]["optional"] == {"anchor": None}
    status = doit(warm, "status:tiny", env=chain)
    assert "  anchor     stale: upstream manifest changed\n" in status.out and "  report     up to date\n" in status.out

    # both in one run: the report comes after the anchor
    run = doit(warm, "anchor:tiny", "report:tiny", env=chain)
    assert run.rc == 0 and run.ran == ["anchor:tiny", "report:tiny"], run.out[-3000:]
    again = json.loads(anchor_json.read_text())
    assert again["digest"] == "0x" + manifest_digest(warm) != anchored["digest"]
    assert f"by transaction {again['tx_hash']}, block {again['block_number']} " in report_text(warm)
