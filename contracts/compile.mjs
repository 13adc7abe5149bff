// Compile AnchorRegistry.sol with the pinned solcjs (package.json) and these settings, and
// write what the build and anyone checking it need: ABI, creation and runtime bytecode, the
// compiler's version and the settings. `node contracts/compile.mjs` rewrites the committed
// contracts/AnchorRegistry.json; tests/test_registry.py recompiles to a temporary file and
// compares, so the committed bytecode is the one this source and compiler make.
import { readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const solc = createRequire(import.meta.url)("solc");
const SOURCE = "AnchorRegistry.sol";
// prague: the newest fork py-evm 0.12 (eth-tester's backend) runs; solc 0.8.37 defaults to osaka.
const SETTINGS = {
  evmVersion: "prague",
  optimizer: { enabled: true, runs: 200 },
  outputSelection: { "*": { "*": ["abi", "evm.bytecode.object", "evm.deployedBytecode.object"] } },
};

const input = { language: "Solidity", sources: { [SOURCE]: { content: readFileSync(join(here, SOURCE), "utf8") } }, settings: SETTINGS };
const output = JSON.parse(solc.compile(JSON.stringify(input)));
const errors = (output.errors || []).filter((e) => e.severity === "error");
if (errors.length) {
  console.error(errors.map((e) => e.formattedMessage).join("\n"));
  process.exit(1);
}
const contract = output.contracts[SOURCE].AnchorRegistry;
const artifact = {
  contract: "AnchorRegistry",
  source: `contracts/${SOURCE}`,
  compiler: { name: "solcjs", version: solc.version() },
  settings: SETTINGS,
  abi: contract.abi,
  bytecode: "0x" + contract.evm.bytecode.object,
  deployedBytecode: "0x" + contract.evm.deployedBytecode.object,
};
writeFileSync(process.argv[2] || join(here, "AnchorRegistry.json"), JSON.stringify(artifact, null, 1) + "\n");
