"""Hash-equal across machines: build a recipe on one machine, bring its plan to a second machine of
the same kind through the remote cache, build there, and compare every stage's digest, and where
one differs, the files that differ (issue 39's last item; the seed's "same plan, same kernels,
hash-equal outputs across machines").

  python -m bench.hash_equal first RECIPE --out DIR
      on the first machine, in the project: `doit manifest:RECIPE`, then `doit push:RECIPE` to
      DIR/remote, of which only the plan's entry and bytes stay (what travels: a few KB);
      every stage's entry goes to DIR/entries (its files' digests, to compare against), and
      DIR/first.json says each stage's key and digest and the machine
  python -m bench.hash_equal second RECIPE --from DIR --out FILE
      on the second machine, in the project: `doit manifest:RECIPE` with MINDXTRAIN_REMOTE=DIR/remote,
      so the plan is fetched (not probed again) and everything else is built here; FILE holds per
      stage both keys and digests and, where the digests differ, the files whose digests differ.
      A build longer than one call (bench/gpu_pipeline.sh with MINDXTRAIN_REMOTE set, resumed on the
      warm machine) can come first: `second` then finds it built, and still tells whether the plan
      was fetched (its stage log is the first machine's)

The plan's key holds the device facts (GPU name, capability, CUDA and library versions), so it is
fetched only where the second machine is of the same kind; otherwise the second plans afresh and
the comparison says so (its plan's key differs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

TRAVELS = "plan"  # the stage whose entry and bytes go to the second machine


def doit(*args: str, env: dict | None = None) -> str:
    """Run doit in the project (the current directory); its output, or SystemExit with its tail."""
    p = subprocess.run([sys.executable, "-m", "doit", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    if p.returncode:
        raise SystemExit(f"doit {' '.join(args)} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout


def machine() -> dict:
    """What tells the two machines apart: lent hosts may share a hostname, so the GPU's UUID and
    the OS's machine id too (None where there is none)."""
    import torch

    cuda = torch.cuda.is_available()
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None) if cuda else None
    machine_id = Path("/etc/machine-id")
    return {"host": platform.node(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "gpu_uuid": None if uuid is None else str(uuid),
            "machine_id": machine_id.read_text().strip() if machine_id.is_file() else None}


def built(recipe: str, stages) -> dict:
    """Each stage's key and digest in the current build (the store's pointers)."""
    from stages.engine.store import Store

    store = Store(Path("artifacts"))
    return {s: store.pointer(recipe, s) for s in stages}


def capped(path: Path) -> bytes:
    """A file DIR carries, read only up to remote.ENTRY_CAP: a larger one ends the run in one line."""
    from stages.engine import remote

    with open(path, "rb") as f:
        data = f.read(remote.ENTRY_CAP + 1)
    if len(data) > remote.ENTRY_CAP:
        raise SystemExit(f"{path}: larger than {remote.ENTRY_CAP} bytes; carry DIR again")
    return data


def carried_first(came: Path) -> dict:
    """DIR's first.json, as `first` writes it: a JSON object whose `stages` give each stage's key and
    digest as strings, and its `machine`. Anything else (too large, not JSON, nested past the
    parser's stack, another shape) ends the run in one line; carried_entry checks the names."""
    path = came / "first.json"
    if not path.is_file():
        raise SystemExit(f"{path}: not there; `--from` names the directory `first` wrote")
    try:
        first = json.loads(capped(path))
    except (ValueError, RecursionError):
        raise SystemExit(f"{path}: not JSON, or nested deeper than it can be read; carry DIR again") from None
    stages = first.get("stages") if isinstance(first, dict) else None
    if not (isinstance(stages, dict) and isinstance(first.get("machine"), dict) and all(
            isinstance(s, dict) and isinstance(s.get("key"), str) and isinstance(s.get("digest"), str)
            for s in stages.values())):
        raise SystemExit(f"{path}: not what `first` writes (a machine, and stages each with a key and a digest); "
                         f"carry DIR again")
    return first


def carried_entry(came: Path, stage: str, key: str) -> dict | None:
    """The first machine's entry of (stage, key) as DIR carries it, checked as a fetch checks a
    remote's (remote.checked: within ENTRY_CAP, the shape push writes, its key and digest its own);
    None where DIR has none. DIR came from another machine: a name in first.json that could lead
    out of DIR, or an entry that fails the check, ends the run in one line."""
    from stages.engine import remote
    from stages.engine.names import named
    from stages.table import STAGES

    if not named(stage, key, STAGES):
        raise SystemExit(f"{came / 'first.json'}: {stage!r} {key!r} is not a stage and key; carry DIR again")
    path = came / "entries" / stage / f"{key}.json"
    if not path.is_file():
        return None
    try:
        return remote.checked(capped(path), stage, key, STAGES, str(path))
    except remote.Rejected as e:
        raise SystemExit(str(e)) from None


def fetched(store, carried: dict | None, now: dict | None) -> bool:
    """Whether this machine's plan is the first machine's, fetched rather than probed again: the
    same key and its stage log byte for byte the first machine's (a fetch installs that log; a
    probe here writes its own). It holds however many calls the build here took."""
    from stages.engine.store import hash_file

    if not carried or not now or not carried["log"] or carried["key"] != now["key"]:
        return False
    log = store.path(TRAVELS, now["key"]).with_suffix(".log")
    return log.is_file() and hash_file(log) == carried["log"]["digest"]


def first(recipe: str, out: Path) -> None:
    doit(f"manifest:{recipe}")
    remote = out / "remote"
    doit(f"push:{recipe}", "--remote", str(remote))
    kept = set()
    for entry in sorted((remote / "ac").glob("*/*.json")):
        stage = entry.parent.name
        (out / "entries" / stage).mkdir(parents=True, exist_ok=True)
        shutil.copy2(entry, out / "entries" / stage / entry.name)
        if stage == TRAVELS:
            e = json.loads(entry.read_text())
            kept |= set(e["sidecar"]["files"].values()) | ({e["log"]["digest"]} if e["log"] else set())
        else:
            entry.unlink()
    for blob in [p for p in (remote / "cas").rglob("*") if p.is_file() and p.name not in kept]:
        blob.unlink()
    stages = sorted(p.name for p in (out / "entries").iterdir())
    (out / "first.json").write_text(json.dumps({"recipe": recipe, "machine": machine(),
                                                "stages": built(recipe, stages)}, indent=1) + "\n")
    print(f"first: {recipe} built and pushed; {out} holds the {TRAVELS} and every stage's entry")


def second(recipe: str, came: Path, out: Path) -> dict:
    from stages.engine.store import Store

    before = carried_first(came)
    entries = {stage: carried_entry(came, stage, was["key"]) for stage, was in before["stages"].items()}
    doit(f"manifest:{recipe}", env={"MINDXTRAIN_REMOTE": str((came / "remote").resolve())})
    here, store = built(recipe, before["stages"]), Store(Path("artifacts"))
    stages = {}
    for stage, was in before["stages"].items():
        now = here[stage]
        row = {"first": was, "second": now, "same_key": was["key"] == now["key"],
               "same_digest": was["digest"] == now["digest"]}
        if not row["same_digest"] and entries[stage]:
            theirs = entries[stage]["sidecar"]["files"]
            ours = store.sidecar(stage, now["key"])["files"]
            row["files_differing"] = sorted(f for f in set(theirs) | set(ours) if theirs.get(f) != ours.get(f))
        stages[stage] = row
    result = {"recipe": recipe, "first_machine": before["machine"], "second_machine": machine(),
              "plan_fetched": fetched(store, entries.get(TRAVELS), here.get(TRAVELS)), "stages": stages,
              "all_equal": all(r["same_digest"] for r in stages.values())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for stage, r in stages.items():
        print(f"{stage:11} {'same' if r['same_digest'] else 'DIFFERS':7} {r['first']['digest'][:12]} "
              f"{r['second']['digest'][:12]}" + (f"  files: {', '.join(r['files_differing'])}"
                                                 if r.get("files_differing") else ""))
    print(f"plan fetched from the first machine: {result['plan_fetched']}; all equal: {result['all_equal']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=["first", "second"])
    ap.add_argument("recipe")
    ap.add_argument("--out", type=Path, required=True, help="first: the directory to carry; second: the result JSON")
    ap.add_argument("--from", dest="came", type=Path, help="second: the directory the first wrote")
    a = ap.parse_args()
    if a.step == "first":
        first(a.recipe, a.out)
    elif a.came is None:
        ap.error("second needs --from DIR (what first wrote)")
    else:
        second(a.recipe, a.came, a.out)


if __name__ == "__main__":
    main()
