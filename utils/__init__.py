"""The math a training step calls, as small functions that read like their formulas: KL estimators, advantages and
the engine/trainer importance weights (rl.py), verifiable reward checking (rewards.py), and the tasks that feed it
(tasks.py)."""
