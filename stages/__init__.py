"""mindxtrain's build, in layers (imports only go downward; tests/test_layout.py checks it):

    stages/table.py      the stage table: one row per stage (what it reads, its module)
    stages/<stage>.py    one module per stage, each a short build(ctx, out) (or, for an action,
                         a doit task generator), in build order:
                         base, plan, shards, checkpoint, quantized, eval, manifest, anchor,
                         report; the actions check (before training) and serve
    stages/data/, train/, scoring/, model/, inference/, view/, chain/
                         a stage's internals; they import no stage module. Two tables live
                         here: the training methods (stages/train/methods.py) and the data
                         kinds (stages/data/kinds/, one module each)
    stages/engine/       graph, store, keys, recipe schema, declared inputs, verify, receipts,
                         remote cache, errors; it imports no stage and no internals

A package's __init__.py holds only its docstring: no stage's key covers it.
"""
