"""What the algorithm scripts share that a reader of one training step may skip: the run's flags, checks, checkpoints
and metrics (run.py), processes and sharding (parallel.py), model loading and GGUF (models.py), LoRA (lora.py), the
start-up memory estimate (memory.py), the rollout engines' start and the HF decode loop (engine.py), partial
rollouts (partial_rollouts.py), held-out evaluation (evaluation.py), --self_check (selfcheck.py), the rollout page
(rollout_page.py) and the tool sandbox (tools.py). The math a step calls is in utils/; the step itself is in each
script."""
