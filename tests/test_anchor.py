"""Anchoring a receipt on a chain: the registry contract on eth-tester's EVM (py-evm) through
web3's EthereumTesterProvider, and `doit anchor` / `doit verify` through web3's HTTP provider
against a real JSON-RPC node (anvil, pinned in contracts/package.json) on 127.0.0.1."""
from __future__ import annotations

import html
import json
import re
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

from conftest import REPO, doit, free_port, snapshot
from stages.chain import node, registry, signer, trust
from stages.engine.errors import UserError
from stages.engine.recipe import load
from stages.engine.store import hash_file, merkle

ANVIL = REPO / "contracts" / "node_modules" / ".bin" / "anvil"
# a registry's address and an account, as anvil's first account deploys and is (for tests without a chain)
REGISTRY, SUBMITTER = "0x5FbDB2315678afecb367f032d93F642f64180aa3", "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"


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


def pin(project: Path, registry_address: str, submitters: list[str], rpc_url: str | None = None, uri: str = "") -> None:
    """Opt the tiny recipe in to anchoring, as docs/anchoring.md says: the registry and its chain
    pinned in the recipe's anchor: section (and the node's URL, if given), the accounts trusted
    to anchor in it in ops/anchor.yaml."""
    recipe = project / "recipes" / "tiny.yaml"
    lines = [f"  registry: \"{registry_address}\"", "  chain_id: 31337"]
    lines += [f"  rpc_url: {rpc_url}"] * bool(rpc_url) + [f"  uri: {uri}"] * bool(uri)
    recipe.write_text(recipe.read_text() + "\nanchor:\n" + "\n".join(lines) + "\n")
    listed = "".join(f"\n      - \"{a}\"" for a in submitters)
    (project / "ops" / "anchor.yaml").write_text(
        f"registries:\n  - chain_id: 31337\n    registry: \"{registry_address}\"\n    submitters:{listed}\n")


def rewrite(obj: Path, rel: str, text: str) -> None:
    """Change a file of a store object and the store's record of it together, as someone who
    forges a receipt would: the store's own checks pass."""
    (obj / rel).chmod(stat.S_IWUSR | stat.S_IRUSR)
    (obj / rel).write_text(text)
    sidecar = obj.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    meta["files"][rel] = blake3.blake3((obj / rel).read_bytes()).hexdigest()
    meta["digest"] = merkle(meta["files"])
    sidecar.chmod(stat.S_IWUSR | stat.S_IRUSR)
    sidecar.write_text(json.dumps(meta))


def stored(project: Path, stage: str) -> Path:
    """The store object the tiny recipe points at for `stage`."""
    key = json.loads((project / "artifacts" / "tiny" / f"{stage}.json").read_text())["key"]
    return project / "artifacts" / "store" / stage / key


def forge_manifest(project: Path) -> str:
    """Another receipt of tiny, self-consistent (an edited one fails verify before the chain is
    asked: tests/test_receipt.py): the manifest rebuilt from a recipe whose checks: section
    differs, which only the receipt records. Returns its digest."""
    recipe = project / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text() + "\nchecks:\n  max_epochs: 11\n")
    run = doit(project, "manifest:tiny")
    assert run.rc == 0 and run.stages_ran() == {"manifest"}, run.out[-2000:]
    return manifest_digest(project)


def outcome(run) -> list[str]:
    """The lines verify printed about the recipes (its own and doit's error lines)."""
    return [line for line in run.out.splitlines() if line.startswith(("error:", "verify:"))]


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
    _, w3, first, second = chain
    address, digest = registry.deploy(w3, first), manifest_digest(warm)
    registry.anchor(w3, address, first, bytes.fromhex(digest), "")
    anchored = {"chain_id": w3.eth.chain_id, "registry": address, "digest": "0x" + digest,
                **registry.anchoring(w3, address, bytes.fromhex(digest))}
    assert registry.check(w3, address, anchored, digest, [first.address])[0] == []

    # the record is the chain's, but anyone could have made it: only a trusted submitter's counts
    problems, _ = registry.check(w3, address, anchored, digest, [second.address])
    assert problems == [f"{digest[:16]} was anchored in registry {address} on chain {w3.eth.chain_id} by "
                        f"{first.address}, who is not trusted to anchor there (ops/anchor.yaml)"]

    key = json.loads((warm / "artifacts" / "tiny" / "manifest.json").read_text())["key"]
    file = warm / "artifacts" / "store" / "manifest" / key / "manifest.json"
    file.chmod(stat.S_IWUSR | stat.S_IRUSR)
    file.write_text(file.read_text().replace('"lr": 0.005', '"lr": 0.004'))
    problems, _ = registry.check(w3, address, anchored, manifest_digest(warm), [first.address])
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


def test_a_recipe_anchors_only_if_it_pins_a_registry_and_with_no_rpc_anchor_says_so(warm):
    before = snapshot(warm)
    env = {"MINDXTRAIN_ANCHOR_RPC_URL": "", "MINDXTRAIN_ANCHOR_CHAIN_ID": "31337",
           "MINDXTRAIN_ANCHOR_REGISTRY": REGISTRY}
    # the environment alone never makes a recipe anchored: tiny pins nothing
    run = doit(warm, "anchor:tiny", env=env)
    assert run.rc != 0
    assert [line for line in run.out.splitlines() if line.startswith("error:")] == [
        "error: anchor:tiny: recipes/tiny.yaml does not anchor: pin a registry and its chain_id in its anchor: "
        "section (docs/anchoring.md); nothing was anchored"], run.out
    assert doit(warm, "verify:tiny", env=env).rc == 0  # and verify needs no chain for it

    pin(warm, REGISTRY, [SUBMITTER])
    run = doit(warm, "anchor:tiny", env=env)
    assert run.rc != 0
    errors = [line for line in run.out.splitlines() if line.startswith("error:")]
    assert errors == ["error: anchor:tiny: no RPC configured (anchor.rpc_url in the recipe, or "
                      "MINDXTRAIN_ANCHOR_RPC_URL); nothing was anchored"], run.out
    assert "Traceback" not in run.out and snapshot(warm) == before


def test_a_registry_is_pinned_with_its_chain(tmp_path, monkeypatch):
    recipe = (REPO / "recipes" / "tiny.yaml").read_text()
    (tmp_path / "recipes").mkdir()
    path = tmp_path / "recipes" / "tiny.yaml"
    path.write_text(recipe + f"\nanchor:\n  registry: \"{REGISTRY}\"\n")
    with pytest.raises(UserError, match="give registry and chain_id together"):
        load(path)
    path.write_text(recipe + f"\nanchor:\n  registry: \"{REGISTRY.lower()}\"\n  chain_id: 31337\n")
    anchored, plain = load(path).anchor, load(REPO / "recipes" / "tiny.yaml").anchor
    for name in node.ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert node.where(anchored) == {"chain_id": 31337, "registry": REGISTRY}
    assert node.where(plain) == {"chain_id": None, "registry": None}
    # for one shell the environment overrides the pins; it never makes a recipe anchored
    monkeypatch.setenv(node.ENV["registry"], SUBMITTER)
    monkeypatch.setenv(node.ENV["chain_id"], "1")
    assert node.where(anchored) == {"chain_id": 1, "registry": SUBMITTER}
    assert node.where(plain) == {"chain_id": None, "registry": None}


def test_the_trusted_submitters_come_from_ops_anchor_yaml_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(trust.ENV, raising=False)
    (tmp_path / "ops").mkdir()
    file = tmp_path / "ops" / "anchor.yaml"
    with pytest.raises(UserError, match=r"^ops/anchor.yaml is missing"):
        trust.submitters(tmp_path, 31337, REGISTRY)
    entry = (f"registries:\n  - chain_id: 31337\n    registry: \"{REGISTRY.lower()}\"\n"
             f"    submitters: [\"{SUBMITTER.lower()}\"]\n")
    file.write_text(entry)
    assert trust.submitters(tmp_path, 31337, REGISTRY) == [SUBMITTER]  # checksummed, as the chain gives them
    for chain_id, other in ((1, REGISTRY), (31337, SUBMITTER)):
        with pytest.raises(UserError, match=f"^ops/anchor.yaml: no entry for registry {other} on chain {chain_id}; add"):
            trust.submitters(tmp_path, chain_id, other)
    monkeypatch.setenv(trust.ENV, f"{REGISTRY}, {SUBMITTER}")  # for one shell: replaces the list
    assert trust.submitters(tmp_path, 1, REGISTRY) == [REGISTRY, SUBMITTER]
    monkeypatch.delenv(trust.ENV)

    for written, error in [
        (entry.replace(SUBMITTER.lower(), SUBMITTER[:-1]),
         rf"^ops/anchor.yaml: registries\[0\].submitters\[0\]: '{SUBMITTER[:-1]}' is not an address"),
        (entry.replace(SUBMITTER.lower(), SUBMITTER.replace("aB", "ab")),  # mixed case, a wrong checksum
         r"^ops/anchor.yaml: registries\[0\].submitters\[0\]: .* is not an address"),
        (entry.replace("31337", "'31337'"), r"^ops/anchor.yaml: registries\[0\].chain_id: '31337' is not a chain id"),
        (entry.replace("submitters: [", "submiters: ["), r"^ops/anchor.yaml: registries\[0\]: give exactly chain_id"),
        (entry + entry[len("registries:\n"):], "^ops/anchor.yaml: more than one entry for registry"),
        ("- a\n", "^ops/anchor.yaml: give one key, registries"),
        ("registries: [\n", r"^ops/anchor.yaml:2: not valid YAML"),
        ("registries:\n  - &one [a]\n  - *one\n", r"^ops/anchor.yaml:3: write the addresses out \(no YAML aliases\)"),
        ("registries: " + "[" * 20 + "]" * 20 + "\n", "^ops/anchor.yaml:1: nested deeper"),
        ("registries: []\n" + "#" * 70_000, "^ops/anchor.yaml: over 64 KiB"),
    ]:
        file.write_text(written)
        with pytest.raises(UserError, match=error):
            trust.submitters(tmp_path, 31337, REGISTRY)


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
    pin(warm, address.lower(), [submitter.address.lower()], url, uri="s3://models/tiny")
    env = {"MINDXTRAIN_ANCHOR_KEY": keys[1], "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    run = doit(warm, "anchor:tiny", env=env)
    assert run.rc == 0, run.out[-3000:]
    assert run.stages_ran() == {"anchor"}  # the anchor: section is no part of the manifest's key
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

    # another manifest, self-consistent: anchor.json anchors another digest (and the chain does not
    # hold this one)
    forged = forge_manifest(warm)
    run = doit(warm, "verify:tiny", env=env)
    assert run.rc != 0, run.out[-2000:]
    assert outcome(run) == [f"error: verify: tiny: anchor: anchor.json anchors {digest[:16]}, not this manifest's "
                            f"digest {forged[:16]} (built since?); run doit anchor:tiny"], run.out[-2000:]


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
    pin(warm, address, [Account.from_key(keys[1]).address], url)
    chain = {"MINDXTRAIN_ANCHOR_KEY": keys[1], "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}

    # the report neither builds the anchor nor reads the chain (builds here reach no network)
    run = doit(warm, "report:tiny")
    assert run.rc == 0 and run.stages_ran() == {"report"}, run.out[-3000:]
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


@pytest.fixture
def anchored(warm, anvil):
    """tiny anchored by `doit anchor` from a trusted account (keys[1]) in the registry its recipe
    pins, on a local node: (project, web3, registry address, anvil's keys, env for doit)."""
    url, keys = anvil
    w3 = Web3(Web3.HTTPProvider(url))
    address = registry.deploy(w3, Account.from_key(keys[0]))
    pin(warm, address, [Account.from_key(keys[1]).address], url)
    env = {"MINDXTRAIN_ANCHOR_KEY": keys[1], "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    run = doit(warm, "anchor:tiny", env=env)
    assert run.rc == 0, run.out[-3000:]
    run = doit(warm, "verify:tiny", env=env)
    assert run.rc == 0 and f"anchor: anchored in registry {address} on chain 31337" in run.out, run.out[-2000:]
    return warm, w3, address, keys, env


def anchor_record(w3, address: str, digest: str) -> str:
    """anchor.json as `doit anchor` writes it, for a digest anchored in `address`: what a forger writes."""
    found = registry.anchoring(w3, address, bytes.fromhex(digest))
    return json.dumps({"chain_id": 31337, "registry": address, "digest": "0x" + digest, **found},
                      indent=1, sort_keys=True) + "\n"


def test_a_forged_manifest_anchored_by_an_untrusted_account_fails_verify_naming_it(anchored):
    project, w3, address, keys, env = anchored
    attacker = Account.from_key(keys[2])
    # the forger rewrites the manifest and the store's record of it, anchors its digest in the
    # pinned registry from their own account (anyone may), and writes anchor.json to match
    forged = forge_manifest(project)
    registry.anchor(w3, address, attacker, bytes.fromhex(forged), "")
    record = anchor_record(w3, address, forged)
    rewrite(stored(project, "anchor"), "anchor.json", record)
    run = doit(project, "verify:tiny", env=env)
    assert run.rc != 0, run.out[-2000:]
    assert outcome(run) == [f"error: verify: tiny: anchor: anchored by {attacker.address}, who is not trusted to "
                            f"anchor in registry {address} on chain 31337 (ops/anchor.yaml)"], run.out[-2000:]

    # anchor.json claiming the trusted account instead: the chain's record names the forger
    trusted = Account.from_key(keys[1]).address
    rewrite(stored(project, "anchor"), "anchor.json", record.replace(attacker.address, trusted))
    run = doit(project, "verify:tiny", env=env)
    assert run.rc != 0, run.out[-2000:]
    assert outcome(run) == [f"error: verify: tiny: anchor: {forged[:16]} was anchored in registry {address} on chain "
                            f"31337 by {attacker.address}, who is not trusted to anchor there (ops/anchor.yaml)"]


def test_anchor_json_naming_a_registry_the_forger_deployed_fails_verify(anchored):
    project, w3, address, keys, env = anchored
    attacker = Account.from_key(keys[2])
    theirs = registry.deploy(w3, attacker)  # the same committed bytecode: check_code alone passes it
    forged = forge_manifest(project)
    registry.anchor(w3, theirs, attacker, bytes.fromhex(forged), "")
    rewrite(stored(project, "anchor"), "anchor.json", anchor_record(w3, theirs, forged))
    run = doit(project, "verify:tiny", env=env)
    assert run.rc != 0, run.out[-2000:]
    assert outcome(run) == [f"error: verify: tiny: anchor: anchor.json names registry {theirs} on chain 31337, not the "
                            f"pinned registry {address} on chain 31337 (the recipe's anchor:, or "
                            f"MINDXTRAIN_ANCHOR_REGISTRY and MINDXTRAIN_ANCHOR_CHAIN_ID); run doit anchor:tiny"]


def test_a_recipe_that_pins_a_registry_and_has_no_anchor_fails_verify(warm, anvil):
    url, keys = anvil
    w3 = Web3(Web3.HTTPProvider(url))
    address = registry.deploy(w3, Account.from_key(keys[0]))
    pin(warm, address, [Account.from_key(keys[1]).address], url)
    env = {"MINDXTRAIN_ANCHOR_KEY": keys[1], "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    not_anchored = ["error: verify: tiny: anchor: not anchored: run doit anchor:tiny"]
    run = doit(warm, "verify:tiny", env=env)  # never anchored
    assert run.rc != 0 and outcome(run) == not_anchored, run.out[-2000:]

    assert doit(warm, "anchor:tiny", env=env).rc == 0
    assert doit(warm, "verify:tiny", env=env).rc == 0
    (warm / "artifacts" / "tiny" / "anchor.json").unlink()  # the recipe's pointer to its anchor
    run = doit(warm, "verify:tiny", env=env)
    assert run.rc != 0 and outcome(run) == not_anchored, run.out[-2000:]


def test_with_no_rpc_verify_checks_the_store_and_says_the_chain_was_not_checked(warm, anvil):
    url, keys = anvil
    w3 = Web3(Web3.HTTPProvider(url))
    address = registry.deploy(w3, Account.from_key(keys[0]))
    pin(warm, address, [Account.from_key(keys[1]).address])  # no rpc_url in the recipe
    rpc = {"MINDXTRAIN_ANCHOR_RPC_URL": url, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    assert doit(warm, "anchor:tiny", env={**rpc, "MINDXTRAIN_ANCHOR_KEY": keys[1]}).rc == 0
    block = json.loads((stored(warm, "anchor") / "anchor.json").read_text())["block_number"]
    trusted = Account.from_key(keys[1]).address

    # a new shell: no RPC configured
    run = doit(warm, "verify:tiny")
    assert run.rc == 0, run.out[-2000:]
    assert outcome(run) == [
        "verify: tiny: intact (stat cache)",
        "verify: tiny: anchor: the chain was not checked: no RPC configured (anchor.rpc_url in the recipe, or "
        f"MINDXTRAIN_ANCHOR_RPC_URL). anchor.json holds this digest in the pinned registry, by {trusted} "
        f"(trusted), block {block}"], run.out[-2000:]
    run = doit(warm, "verify:tiny", "--require-anchor")
    assert run.rc != 0 and outcome(run) == [
        "error: verify: tiny: anchor: the chain was not checked, and --require-anchor asks for it: no RPC "
        "configured (anchor.rpc_url in the recipe, or MINDXTRAIN_ANCHOR_RPC_URL)"], run.out[-2000:]
    run = doit(warm, "verify", env={"MINDXTRAIN_VERIFY_REQUIRE_ANCHOR": "1"})
    assert run.rc != 0 and "error: verify: 1 of 1 built recipe failed (tiny); their lines are above" in run.out

    # a node that does not answer is the same; with one, the chain is read
    dead = {"MINDXTRAIN_ANCHOR_RPC_URL": f"http://127.0.0.1:{free_port()}", "NO_PROXY": "127.0.0.1"}
    run = doit(warm, "verify:tiny", env=dead)
    assert run.rc == 0 and "anchor: the chain was not checked: cannot reach the JSON-RPC node at " in run.out
    run = doit(warm, "verify:tiny", "--require-anchor", env=rpc)
    assert run.rc == 0 and f"anchor: anchored in registry {address} on chain 31337 by {trusted} (trusted)" in run.out

    # what is local is checked all the same: anchor.json must be this manifest's
    forge_manifest(warm)
    run = doit(warm, "verify:tiny")
    assert run.rc != 0 and "anchor.json anchors " in run.out, run.out[-2000:]


def test_anchor_refuses_an_account_that_is_not_trusted_and_a_digest_one_anchored(warm, anvil):
    url, keys = anvil
    w3 = Web3(Web3.HTTPProvider(url))
    address = registry.deploy(w3, Account.from_key(keys[0]))
    pin(warm, address, [Account.from_key(keys[1]).address], url)
    stranger = Account.from_key(keys[2])
    env = {"MINDXTRAIN_ANCHOR_KEY": keys[2], "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    assert doit(warm, "manifest:tiny").rc == 0  # the store settled before the snapshot
    before, height = snapshot(warm), w3.eth.block_number
    run = doit(warm, "anchor:tiny", env=env)
    assert run.rc != 0 and [line for line in run.out.splitlines() if line.startswith("error:")] == [
        f"error: anchor:tiny: {stranger.address} is not trusted to anchor in registry {address} on chain 31337: "
        f"add it to that registry's submitters in ops/anchor.yaml, or sign with an account listed there; "
        f"nothing was anchored"], run.out[-2000:]
    assert w3.eth.block_number == height and snapshot(warm) == before

    # the digest anchored first by a stranger: the registry is write-once, so no anchor of it
    # there can be a trusted one; recorded, it would only fail verify
    digest = manifest_digest(warm)
    registry.anchor(w3, address, stranger, bytes.fromhex(digest), "")
    run = doit(warm, "anchor:tiny", env={**env, "MINDXTRAIN_ANCHOR_KEY": keys[1]})
    assert run.rc != 0 and [line for line in run.out.splitlines() if line.startswith("error:")] == [
        f"error: anchor:tiny: {digest[:16]} is anchored in registry {address} on chain 31337 already, by "
        f"{stranger.address}, who is not trusted to anchor there (ops/anchor.yaml); the registry is write-once, so "
        f"anchor this manifest in another registry; nothing was anchored"], run.out[-2000:]
    assert snapshot(warm) == before


def test_plain_verify_checks_every_recipe_and_fails_at_the_end(warm):
    # a second recipe: tiny with a check setting that no stage reads, so only its manifest is new
    tiny = (warm / "recipes" / "tiny.yaml").read_text()
    (warm / "recipes" / "tiny_copy.yaml").write_text(tiny + "\nchecks:\n  max_epochs: 9\n")
    run = doit(warm, "manifest:tiny_copy")
    assert run.rc == 0 and run.stages_ran("tiny_copy") == {"manifest"}, run.out[-2000:]
    assert doit(warm, "verify").rc == 0

    manifest = stored(warm, "manifest") / "manifest.json"  # tiny's, not tiny_copy's
    manifest.chmod(stat.S_IWUSR | stat.S_IRUSR)
    manifest.write_text(manifest.read_text().replace('"lr": 0.005', '"lr": 0.004'))
    run = doit(warm, "verify")
    assert run.rc != 0, run.out[-2000:]
    lines = [line for line in outcome(run) if "never built" not in line]
    assert lines[1:] == ["verify: tiny_copy: intact (stat cache)",
                         "error: verify: 1 of 2 built recipes failed (tiny); their lines are above"], run.out[-2000:]
    assert lines[0].startswith("verify: tiny: manifest: manifest.json differs"), lines

    # named, a recipe fails on its own, at once
    run = doit(warm, "verify:tiny", "verify:tiny_copy")
    assert run.rc != 0 and run.ran == ["verify:tiny"], run.out[-2000:]
    assert outcome(run)[0].startswith("error: verify: tiny: manifest: manifest.json differs"), run.out[-2000:]

    # with doit's --continue the group task fails for want of its last one: no time for a task that never ran
    run = doit(warm, "--continue", "verify")
    summary = run.out[run.out.index("summary\n"):].splitlines()
    assert run.rc != 0 and ["verify", "FAILED"] in [line.split() for line in summary], summary
    assert "-0.0s" not in run.out
