"""mindxtrain's build, in three layers (imports only go downward):

    stages/table.py      the stage table: one row per stage (what it reads, its module)
    stages/<stage>.py    one module per stage: base, plan, shards, checkpoint, quantized,
                         evaluate (eval), manifest; each a short build(ctx, out)
    stages/data/, train/, model/   a stage's internals; they import no stage module
    stages/engine/       graph, store, keys, recipe schema, declared inputs, verify, errors;
                         it imports no stage and no internals
"""
