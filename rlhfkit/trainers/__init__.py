"""Training loops: sft, reward, dpo, kto, and one RL loop for every estimator."""
