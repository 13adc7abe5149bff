"""GSPO (Group Sequence Policy Optimization, https://huggingface.co/papers/2507.18071): GRPO with
one importance ratio per sequence instead of one per token. The data, rewards and trainer are
GRPO's (stages/train/grpo.py: TRL's GRPOTrainer on the shards' prompts, train.reward against each
prompt's reference); only GRPOConfig's settings differ, those TRL's paper index gives to reproduce
the paper (https://huggingface.co/docs/trl/en/paper_index#group-sequence-policy-optimization, TRL
1.16's GRPOConfig fields):

- importance_sampling_level="sequence": the ratio of a completion is the exponential of its mean
  per-token log-ratio (new policy over the one that sampled it), one weight for the whole
  sequence, clipped as one, as the sequence is rewarded as one.
- loss_type="grpo": each sequence's loss averaged over its tokens, then over sequences: with
  sequence-level ratios that is the paper's per-sequence objective. TRL's default ("dapo") and
  "bnpo", "dr_grpo", "cispo" sum per-token terms, weighting each sequence by its length; TRL warns
  and names "grpo" for the paper's setup.
- beta=0.0: no KL term, so no reference model (TRL's note: GSPO set the KL regularization to zero).
- epsilon=3e-4, epsilon_high=4e-4: the paper's clipping range (v2, section 5.1). A sequence ratio
  is a mean over tokens and stays near 1, so its range is far narrower than GRPO's 0.2.
- steps_per_generation = 4 x the plan's grad_accum: each rollout batch split into 4 optimizer
  steps (paper v2, 5.1; TRL: "Must be 4 times gradient_accumulation_steps"). TRL's index asks for
  gradient_accumulation_steps=1; here the plan splits the recipe's global batch, so the 4 scales
  with it instead. TRL notes GSPO differs from GRPO only off-policy (steps_per_generation above
  grad_accum, or num_iterations above 1): the first step on a rollout is on-policy, the next three
  are not, and there the sequence ratio and its clip act. A rollout samples four steps' prompts at
  once; each step still trains on the recipe's global batch, so max_steps sees as many prompts as
  under grpo.
"""
from __future__ import annotations

from pathlib import Path

from stages.train import grpo

ROLLOUT_SPLIT = 4  # optimizer steps per rollout batch (GSPO paper v2, section 5.1)


def dataset(shards: Path, tok):
    return grpo.dataset(shards, tok)


def settings(plan: dict) -> dict:
    """GRPOConfig's fields for GSPO as TRL documents them (the module's docstring says why each)."""
    return dict(importance_sampling_level="sequence", loss_type="grpo", beta=0.0, epsilon=3e-4, epsilon_high=4e-4,
                steps_per_generation=ROLLOUT_SPLIT * plan["grad_accum"])


def make_trainer(method, model, train, tok, plan: dict, t, output_dir: Path):
    return grpo.make_trainer(method, model, train, tok, plan, t, output_dir, **settings(plan))
