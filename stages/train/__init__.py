"""Training internals: the table of methods (methods), the plan's probe (autotune), what its
decisions do to a model (settings), the shared trainer set-up (trainer, distributed), one module
per method's trainer (sft for sft and cpt, dpo for dpo and orpo, kto, reward, grpo, and gspo
over grpo's), the pairs and prompts of the shards as TRL takes them (pairs), and the verifiable
rewards of GRPO and GSPO (verifiers)."""
