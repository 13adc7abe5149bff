"""The engine: the stage table made into doit tasks, keys, the store, the recipe schema,
what a stage may read, and verify. It knows no stage by name."""
