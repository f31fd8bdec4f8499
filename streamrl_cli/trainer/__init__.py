"""The trainer role: PPO/GRPO on DeepSpeed, consuming the sample stream."""
