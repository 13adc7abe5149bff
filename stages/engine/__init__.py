"""The engine: the stage table made into doit tasks, keys, the store, the recipe schema,
what a stage may read, and verify. It knows no stage by name, and importing it does nothing.

    stage.py     a row of the stage table (Stage) and the module it names
    project.py   the project doit runs in: its directory, recipes, store; per-recipe tasks
    inputs.py    what a stage's key is made of (code, recipe fields, upstream digests, versions)
    keys.py      a key: BLAKE3 of the canonical JSON of those inputs
    build.py     a stage built: its Context, its build run, its artifact committed; is_built
    terminal.py  where a stage's output goes while it builds: its own lines and progress bars to the
                 console, what its libraries print or log to its log, their warnings counted
    console.py   what a doit run prints (the Reporter and its summary)
    tasks.py     the stage table as doit tasks, and DOIT_CONFIG
    store.py, recipe.py, declared.py, errors.py      the store, the schema, views, UserError
    show.py, status.py, verify.py, receipt.py, sync.py, remote.py, catalogue.py
                 the engine's own verbs: doit show, status, verify, push/pull, recipes
"""
