"""The eval stage's internals for the held-out rows of each training method's data kind."""
