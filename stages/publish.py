"""publish: a build uploaded to the Hugging Face Hub through huggingface_hub, in one commit: the
model card (the card stage's README.md), the trained model (full weights, or the PEFT adapter)
with the base's tokenizer, each quantized export under quantized/<scheme>/, and the receipt
(mindxtrain/manifest.json, and anchor.json where this build is anchored).

`doit publish:<recipe> --repo owner/name` (else the recipe's publish.repo) uploads, once the
receipt verifies, with the token huggingface_hub finds (HF_TOKEN, or `hf auth login`), and
records the repo and the commit in published.json, an artifact of its own in the store
(artifacts/<recipe>/latest/publish/published.json), keyed by the manifest's digest, the card's
and the repo, as the anchor stage records a chain's answer. `--dry-run` lists what would be
uploaded and contacts nothing. With no token, or no Hub to reach, it says so in one line and
nothing changes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from doit.exceptions import TaskFailed

from stages.engine import inputs, jsontext, keys, project, verify
from stages.engine.errors import UserError
from stages.engine.recipe import HUB_REPO

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def uploads(recipe_name: str, table: dict) -> tuple[list[tuple[str, Path]], dict]:
    """(path in the repo, local file) of everything a publish uploads, and the manifest's pointer,
    once the receipt verifies and the card of this build is built; UserError otherwise."""
    st = project.store()
    found = verify.problems(recipe_name, False, table)
    found = found or verify.self_consistent(recipe_name, table)[0]
    if found:
        raise UserError(f"publish:{recipe_name}: the receipt does not verify ({found[0]}); nothing uploaded")
    manifest_ptr = st.pointer(recipe_name, "manifest")
    card = inputs.built_for(recipe_name, table["card"], table)
    if card is None:
        raise UserError(f"publish:{recipe_name}: no model card of this build; run doit card:{recipe_name}")
    manifest = jsontext.read(st.path("manifest", manifest_ptr["key"]) / "manifest.json")
    arts = manifest["artifacts"]
    obj = {stage: st.path(stage, art["key"]) for stage, art in arts.items()}
    files = [("README.md", st.path("card", card["key"]) / "README.md")]
    for rel in sorted(arts["checkpoint"]["files"]):
        if rel.startswith(("model/", "adapter/")):
            files.append((rel.split("/", 1)[1], obj["checkpoint"] / rel))
    files += [(rel, obj["base"] / rel) for rel in TOKENIZER  # where the trained model has none of its own
              if rel in arts["base"]["files"] and rel not in {path for path, _ in files}]
    files += [(f"quantized/{rel}", obj["quantized"] / rel) for rel in sorted(arts["quantized"]["files"])
              if "/" in rel]
    files.append(("mindxtrain/manifest.json", st.path("manifest", manifest_ptr["key"]) / "manifest.json"))
    anchor = inputs.built_for(recipe_name, table["anchor"], table)
    if anchor is not None:
        files.append(("mindxtrain/anchor.json", st.path("anchor", anchor["key"]) / "anchor.json"))
    return files, {"manifest": manifest_ptr["digest"], "card": card["digest"]}


def upload(repo: str, private: bool, files: list[tuple[str, Path]], message: str) -> dict:
    """One commit of every file to the Hub model repo (created private if absent); the commit."""
    from huggingface_hub import CommitOperationAdd, HfApi, get_token
    from huggingface_hub.errors import HTTPError

    token = get_token()
    if token is None:
        raise UserError("no Hugging Face token: set HF_TOKEN, or run `hf auth login`; nothing uploaded")
    api = HfApi(token=token)
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        info = api.create_commit(repo, [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(f)) for p, f in files],
                                 commit_message=message)
    except (HTTPError, OSError) as e:
        raise UserError(f"cannot publish to {repo} on {api.endpoint} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else 'no answer'}); nothing recorded") from None
    return {"commit": info.oid, "url": info.commit_url}


def record(recipe_name: str, inputs: dict, published: dict) -> None:
    """published.json in the store under the key of what was published, and the recipe's pointer."""
    st, key = project.store(), keys.key_of(inputs)
    with st.building("publish", key, lambda: None):
        tmp = st.temp_dir("publish", key)
        try:
            (tmp / "published.json").write_text(json.dumps(published, indent=1, sort_keys=True) + "\n")
            meta = st.commit("publish", key, tmp, {"inputs": inputs})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    st.set_pointer(recipe_name, "publish", key, meta["digest"])


def run(recipe_name: str, table: dict, repo: str | None, dry_run: bool):
    try:
        r = project.recipe(recipe_name)
        repo = repo or r.publish.repo
        if repo is None or not HUB_REPO.fullmatch(repo):
            raise UserError(f"publish:{recipe_name}: say where: --repo owner/name, or publish.repo in "
                            f"recipes/{recipe_name}.yaml" + (f" ({repo!r} is not a Hub repo id)" if repo else ""))
        files, digests = uploads(recipe_name, table)
        if dry_run:
            for path, local in files:
                print(f"publish:{recipe_name}: would upload {path} ({local.stat().st_size} bytes)", flush=True)
            print(f"publish:{recipe_name}: {len(files)} files to {repo} (dry run: nothing sent)", flush=True)
            return None
        published = upload(repo, r.publish.private, files,
                           f"mindxtrain {recipe_name}: manifest {digests['manifest'][:12]}")
    except UserError as e:
        return TaskFailed(str(e) if str(e).startswith("publish:") else f"publish:{recipe_name}: {e}")
    record(recipe_name, {"stage": "publish", "repo": repo, **digests},
           {"repo": repo, **published, "manifest_digest": digests["manifest"], "files": [p for p, _ in files]})
    print(f"publish:{recipe_name}: {repo} at commit {published['commit']} ({published['url']})", flush=True)
    return None


PARAMS = [{"name": "repo", "long": "repo", "type": str, "default": None,
           "help": "the Hub model repo, owner/name (default: the recipe's publish.repo)"},
          {"name": "dry_run", "long": "dry-run", "type": bool, "default": False,
           "help": "list what would be uploaded; contact nothing"}]


def tasks(table: dict):
    return project.recipe_tasks("publish", "upload the build, its model card and receipt to the Hub",
                                lambda name: {"actions": [(run, [name, table])], "task_dep": [f"card:{name}"],
                                              "params": PARAMS})
