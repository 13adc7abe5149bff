"""The shards stage's internals: reading rows, cleaning, chat templates and tokenization,
the prepared chunks, the held-out split and length rules, and writing shards."""
