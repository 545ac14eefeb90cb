"""Adapters that let RL frameworks drive jaxserve as their rollout engine (docs/rl.md).

`jaxserve.rl.tunix_rollout.JaxserveRollout`: Tunix's `BaseRollout` (needs `google-tunix`)."""
