"""The rollout engine a script samples from, and how it is started. What a script does with it (wake it, push the
policy's weights, generate, put it back to sleep) is written in the script: its generate() under the "Rollout engine"
header (grpo_tools.py: rollout(), under "Tool calls", around its turns)."""

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import torch

from utils.parallel import free_port


@dataclass
class Engine:
    """The rollout engine: a colocated vLLM engine (llm), or, when llm is None, the HF decode loop over the policy."""
    stop_ids: list  # token ids that end a completion
    llm: object = None
    asleep: bool = False  # uses sleep mode (GPU): woken for each rollout, put back to sleep after it (not a state)
    sleep_level: int = 2
    weights_version: Optional[int] = None  # training steps the engine's weights include (None: none, or dropped)


def create_engine(run, model, seed, max_model_len, stop_ids):
    """One in-process vLLM engine per rank (external_launcher) for `model`, sampling with `seed`, holding prompt and
    completion in max_model_len tokens; or the HF decode loop (--engine hf, or no CUDA or no vLLM). run: the run's
    engine flags (--engine, --vllm_gpu_memory_utilization, --vllm_sleep_level). Both end a completion at its first
    stop token. seed and max_model_len are vLLM's only."""
    vllm_installed = importlib.util.find_spec("vllm") is not None
    if run.engine == "hf" or (run.engine == "auto" and not (vllm_installed and torch.cuda.is_available())):
        return Engine(stop_ids)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(key, value)  # a plain `python grpo.py` is a world of one
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    extra = {"gpu_memory_utilization": run.vllm_gpu_memory_utilization, "enable_sleep_mode": True} if on_gpu else {
        "kv_cache_memory_bytes": 256 * 2**20, "enforce_eager": True}  # CPU build: no sleep mode, small explicit KV
    # cache, no torch.compile (its start takes longer than a CPU run's generation saves: benchmarks/vllm_start.py)
    llm = LLM(model, distributed_executor_backend="external_launcher", seed=seed, dtype="bfloat16" if on_gpu else
              "float32", max_model_len=max_model_len, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
              **extra)
    if on_gpu:
        llm.sleep(level=run.vllm_sleep_level)
    return Engine(stop_ids, llm, asleep=on_gpu, sleep_level=run.vllm_sleep_level)
