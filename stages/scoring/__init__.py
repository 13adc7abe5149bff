"""The eval stage's internals: lm-eval's harness over held-out docs (harness; each data kind
says what to measure on its rows, stages/data/kinds/) and a reward model's ranking of held-out
pairs (reward_ranking)."""
