"""push and pull: a recipe's current build to and from a remote cache (stages/engine/remote.py).

`doit push:<recipe>` uploads every stage of what the recipe resolves to now, once all of them are
built; `doit pull:<recipe>` computes each stage's key here, in build order, as a build would, and
installs the remote's entry for it, so that a build afterwards finds everything and runs nothing.
The remote is --remote <url>, else MINDXTRAIN_REMOTE.
"""
from __future__ import annotations

from doit.exceptions import TaskFailed

from stages.engine import jsontext, keys, names, remote
from stages.engine.errors import UserError
from stages.engine.inputs import key_inputs
from stages.engine.project import recipe_tasks, store


def current_keys(recipe_name: str, table: dict) -> list[tuple[str, str]]:
    """Each stage's key for the recipe as it is now, all built; UserError naming the first not built."""
    st, found = store(), []
    for name, stage in table.items():
        key = keys.key_of(key_inputs(recipe_name, stage, table))
        if st.damage(name, key):
            raise UserError(f"push:{recipe_name}: {name} is not built as the recipe is now; "
                            f"run doit manifest:{recipe_name}, then push")
        st.set_pointer(recipe_name, name, key, st.sidecar(name, key)["digest"])  # as doit's up-to-date check does
        found.append((name, key))
    return found


def named_by_manifest(recipe_name: str) -> list[tuple[str, str]]:
    """The entries the recipe's manifest names, which verify checks: where an upstream was rebuilt
    with the same bytes under a new key (early cutoff), the manifest still names the earlier key."""
    st = store()
    manifest = jsontext.read(st.path("manifest", st.pointer(recipe_name, "manifest")["key"]) / "manifest.json")
    return [(name, art["key"]) for name, art in manifest["artifacts"].items()]


def named_by_pulled_manifest(rem, recipe_name: str, table: dict) -> list[tuple[str, str]]:
    """named_by_manifest for a manifest the remote gave, whose names are data to check as an entry's
    `also` is: each a stage of the table with a key's form, else a one-line Rejected naming the entry."""
    where = rem.where("manifest", store().pointer(recipe_name, "manifest")["key"])
    try:
        named = named_by_manifest(recipe_name)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise remote.Rejected(f"{where}: its manifest.json is not a manifest ({type(e).__name__}); nothing fetched "
                              f"for it: push it again from a store that has it intact") from None
    for name, key in named:
        if not names.named(name, key, table):
            raise remote.Rejected(f"{where}: its manifest names {remote.quoted(name)} {remote.quoted(key)}, not "
                                  f"{remote.NAMED}; nothing fetched for it: push it again from a store that has it "
                                  f"intact")
    return named


def push(recipe_name: str, table: dict, remote_url: str = ""):
    st = store()
    try:
        rem = remote.configured(remote_url)
        current = current_keys(recipe_name, table)
        earlier = [e for e in named_by_manifest(recipe_name) if e not in current]
        for name, key in earlier:
            if st.damage(name, key):
                raise UserError(f"push:{recipe_name}: the manifest names {name} {key[:12]}, which is not in the "
                                f"store (doit verify:{recipe_name} fails too): rebuild the manifest, then push")
        for name, key in earlier + current:  # the manifest's entry last, naming the earlier ones to fetch with it
            sent, size = rem.push(st, name, key, earlier if name == "manifest" else ())
            print(f"{name}:{recipe_name}: {key[:12]} " + (f"pushed {sent} files, {size / 1e6:.1f} MB" if sent
                                                          else "in the remote"), flush=True)
    except UserError as e:
        return TaskFailed(str(e))
    except OSError as e:
        return TaskFailed(f"push:{recipe_name}: cannot write the remote {rem.url} ({e}); what was pushed stays, "
                          f"unseen until its entry is written: fix it and push again")
    print(f"push:{recipe_name}: {rem.url} holds the recipe's build", flush=True)
    return None


def install(rem, recipe_name: str, name: str, key: str, table: dict, what: str = "") -> str | None:
    """One entry from the remote into the store, unless it is there, saying which: "pulled" or
    "already in the store"; None where the remote lacks it. `what` says what the entry is where
    that is not plain (the manifest's earlier one). The remote is untrusted: the stage table says
    which stages an entry may name."""
    st = store()
    if not st.damage(name, key):
        print(f"{name}:{recipe_name}: {key[:12]}{what} already in the store", flush=True)
        return "already in the store"
    if rem.fetch(st, name, key, table, lambda: print(f"{name}:{recipe_name}: another process is installing "
                                                     f"{key[:12]}; waiting", flush=True)):
        print(f"{name}:{recipe_name}: {key[:12]}{what} pulled", flush=True)
        return "pulled"
    return None


def pull(recipe_name: str, table: dict, remote_url: str = ""):
    st, done = store(), {}
    try:
        rem = remote.configured(remote_url)
        for name, stage in table.items():
            key = keys.key_of(key_inputs(recipe_name, stage, table))
            done[name, key] = install(rem, recipe_name, name, key, table)
            if done[name, key] is None:
                return TaskFailed(f"pull:{recipe_name}: {name} ({key[:12]}) is not in the remote {rem.url}; "
                                  f"build it with doit manifest:{recipe_name} (and push it)")
            st.set_pointer(recipe_name, name, key, st.sidecar(name, key)["digest"])
        for name, key in named_by_pulled_manifest(rem, recipe_name, table):
            if (name, key) in done:  # said above: each entry once
                continue
            # an upstream rebuilt with the same bytes under a new key (early cutoff): the manifest names the first
            done[name, key] = install(rem, recipe_name, name, key, table, " (the one the manifest names)")
            if done[name, key] is None:
                return TaskFailed(f"pull:{recipe_name}: the manifest names {name} {key[:12]}, which is not in the "
                                  f"remote {rem.url}: push it from the store that built it")
    except UserError as e:
        return TaskFailed(str(e))
    except OSError as e:
        return TaskFailed(f"pull:{recipe_name}: cannot read the remote {rem.url} ({e}); nothing half-installed: "
                          f"fix it and pull again")
    pulled = sum(how == "pulled" for how in done.values())
    print(f"pull:{recipe_name}: the recipe's build is in the store ({pulled} of {len(done)} entries pulled from "
          f"{rem.url})", flush=True)
    return None


PARAMS = [{"name": "remote_url", "long": "remote", "type": str, "default": "",
           "help": f"fsspec URL of the remote (default: ${remote.SETTING})"}]


def tasks(table: dict, verb: str):
    """A recipe's build is what its receipt covers: the manifest and the stages it names (views
    downstream of it, the report, are rebuilt from them in seconds)."""
    table = {name: stage for name, stage in table.items()
             if name == "manifest" or name in table["manifest"].upstream}
    action, doc = {"push": (push, "upload the recipe's current build to the remote cache"),
                   "pull": (pull, "install the recipe's build from the remote cache")}[verb]
    return recipe_tasks(verb, doc, lambda name: {"actions": [(action, [name, table])], "params": PARAMS})
