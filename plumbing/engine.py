"""The rollout engines a script samples from: the colocated vLLM engine, its start and the details of each step a
script's generate() takes with it (wake, push the policy's weights if they lag, generate, sleep: the sequence is
written in the script, each step one call to Engine), and the HF decode loop, for CPUs and runs without vLLM: a loop
over the policy's own forward pass and KV cache that samples as vLLM does (tempered top-p nucleus, the log-prob of
each drawn token under that distribution). Both give a script the same Samples."""

import importlib.util
import os
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from plumbing.parallel import free_port, policy_weights


@dataclass
class Engine:
    """The rollout engine: a colocated vLLM engine (llm), or, when llm is None, the HF decode loop over the policy."""
    stop_ids: list  # token ids that end a completion
    llm: object = None
    asleep: bool = False  # uses sleep mode (GPU): woken for each rollout, put back to sleep after it (not a state)
    sleep_level: int = 2
    weights_version: Optional[int] = None  # training steps the engine's weights include (None: none, or dropped)
    cuda_bytes: int = 0  # what torch's CUDA allocator counts for the engine, asleep too (the trainer's figures less it)
    gpu_fraction: Optional[float] = None  # the GPU's share the engine takes awake (--vllm_gpu_memory_utilization)

    def wake(self, tags):
        """GPU sleep mode: wake the engine's "weights" (before a push), then its "kv_cache" (before sampling), each
        after handing it the trainer's cached blocks (without that the weights, then the KV cache, may find no room).
        A no-op without sleep mode (a CPU)."""
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=[tags])

    def push_weights(self, model, accelerator, policy_version):
        """The policy's full weights into the engine, one gathered tensor at a time (FSDP2 DTensors are all-gathered),
        when the engine's lag the policy's (policy_version: the training steps they include; the first call always
        pushes: never stale or dropped weights) -> seconds spent pushing (0.0 when none was needed, and for the HF
        decode loop, which samples from the policy itself)."""
        if self.llm is None or self.weights_version == policy_version:
            return 0.0
        start = time.time()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model, accelerator)})
        self.llm.reset_prefix_cache()  # stale prefix-cache entries would serve the old weights' KV
        self.weights_version = policy_version
        return time.time() - start

    def sleep(self):
        """After sampling, in GPU sleep mode: the engine's memory back to the trainer (at --vllm_sleep_level 2 its
        weights are dropped too: the next rollout pushes them again)."""
        if self.asleep:
            self.llm.sleep(level=self.sleep_level)
            if self.sleep_level == 2:
                self.weights_version = None


def uses_vllm(run):
    """Whether the run samples with vLLM: --engine vllm, or --engine auto with vLLM installed and a GPU."""
    return run.engine == "vllm" or (run.engine == "auto" and importlib.util.find_spec("vllm") is not None and
                                    torch.cuda.is_available())


def create_engine(run, model, seed, max_model_len, stop_ids):
    """One in-process vLLM engine per rank (external_launcher) for `model`, sampling with `seed`, holding prompt and
    completion in max_model_len tokens; or the HF decode loop (--engine hf, or no CUDA or no vLLM). run: the run's
    engine flags (--engine, --vllm_gpu_memory_utilization, --vllm_sleep_level). Both end a completion at its first
    stop token. seed and max_model_len are vLLM's only."""
    if not uses_vllm(run):
        return Engine(stop_ids)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(key, value)  # a plain `python grpo.py` is a world of one
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    before = torch.cuda.memory_allocated() if on_gpu else 0
    # the CPU build: no sleep mode, a small explicit KV cache, no torch.compile (its start takes longer than a CPU
    # run's generation saves: benchmarks/vllm_start.py)
    extra = {"gpu_memory_utilization": run.vllm_gpu_memory_utilization, "enable_sleep_mode": True} if on_gpu else {
        "kv_cache_memory_bytes": 256 * 2**20, "enforce_eager": True}
    llm = LLM(model, distributed_executor_backend="external_launcher", seed=seed, dtype="bfloat16" if on_gpu else
              "float32", max_model_len=max_model_len, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
              **extra)
    if on_gpu:  # sleep unmaps the engine's pages but keeps its tensors: torch's allocator still counts them, and
        llm.sleep(level=run.vllm_sleep_level)  # every max_memory_allocated() after this includes them
    held = torch.cuda.memory_allocated() - before if on_gpu else 0
    return Engine(stop_ids, llm, asleep=on_gpu, sleep_level=run.vllm_sleep_level, cuda_bytes=held,
                  gpu_fraction=run.vllm_gpu_memory_utilization if on_gpu else None)


class Sample(NamedTuple):
    """One sampled completion, from either engine."""
    token_ids: list  # the completion's tokens, its stop token included when it has one
    logprobs: Optional[list]  # the engine's log-prob of each token; None for greedy decoding
    truncated: bool  # it ran out of new tokens before a stop token


class HFDecoder:
    """generate(): n completions per prompt, each ending at its first token in stop_ids or after max_new_tokens.

    Each prompt is prefilled once for its n completions and finished rows leave the batch and the cache, so a decode
    step costs the completions still running (2.1x faster than transformers' generate() on the toy:
    benchmarks/hf_decode.py). Under FSDP every rank runs every forward pass (each gathers the weights): a rank whose
    rows are done keeps a dummy row until every rank is done. `budgets`: each row's own limit of new tokens (a
    continued completion has fewer left; None: max_new_tokens for every row). `stop_strings`: a row whose text
    reaches one ends there, its tokens kept (vLLM's `stop`; grpo_tools.py's end of a code block). Rollouts of another
    shape subclass it (plumbing/partial_rollouts.py) and override the two hooks below."""

    def __init__(self, stop_ids, budgets=None, stop_strings=()):
        self.stop_ids, self.budgets, self.stop_strings = stop_ids, budgets, tuple(stop_strings)

    def stops(self, tokenizer, tokens, rows, t):
        """(len(rows),) bool: rows that end at step t for another reason than a stop token (not truncated): a stop
        string completed by the newest tokens (only they can complete one: every token is at least one character)."""
        if not self.stop_strings:
            return torch.zeros(len(rows), dtype=torch.bool)
        width = max(map(len, self.stop_strings))
        tails = tokenizer.batch_decode(tokens[rows, max(0, t + 1 - width):t + 1].tolist())
        return torch.tensor([any(stop in tail for stop in self.stop_strings) for tail in tails])

    def enough(self, ended):
        """Called each step with the rows that ended at it: True stops decoding, the running rows as they are."""
        return False

    @torch.no_grad()
    def generate(self, model, tokenizer, prompts, n, temperature, top_p, max_new_tokens, accelerator):
        """prompts: token-id lists -> n * len(prompts) Samples, the n completions of each prompt together."""
        from transformers import DynamicCache

        unwrapped, device, total = accelerator.unwrap_model(model), accelerator.device, len(prompts) * n
        inputs = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt").to(device)
        prompt_width, stop_ids = inputs["input_ids"].shape[1], torch.tensor(self.stop_ids, device=device)
        positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        attention_mask = torch.cat([inputs["attention_mask"], positions.new_ones(len(prompts), max_new_tokens)], 1)
        fsdp = accelerator.distributed_type == "FSDP"  # a str enum
        tokens = torch.full((total + 1, max_new_tokens), tokenizer.pad_token_id, device=device)  # the last: dummy's
        logprobs = torch.zeros(total + 1, max_new_tokens, device=device)
        lengths, cut = torch.zeros(total + 1, dtype=torch.long, device=device), torch.zeros_like(tokens[:, 0]).bool()
        own = torch.full((total,), max_new_tokens) if self.budgets is None else torch.tensor(self.budgets)
        limits = torch.cat([own, torch.tensor([max_new_tokens])]).to(device)
        rows = torch.arange(total, device=device)  # the output row of each batch row
        cache, input_ids = DynamicCache(config=unwrapped.config), inputs["input_ids"]
        with torch.inference_mode(not fsdp):  # cheaper than no_grad; FSDP2 must not gather weights as inference tensors
            for t in range(max_new_tokens):
                logits = unwrapped(input_ids=input_ids, attention_mask=attention_mask[:, :prompt_width + t],
                                   position_ids=positions, past_key_values=cache, use_cache=True,
                                   logits_to_keep=1).logits[:, -1].float()  # (FSDP2's bf16 policy gives bf16)
                if t == 0 and n > 1:  # each prompt was prefilled once: its cache and logits serve its n completions
                    cache.batch_repeat_interleave(n)
                    logits, attention_mask, positions = (x.repeat_interleave(n, 0) for x in (logits, attention_mask,
                                                                                             positions))
                if rows[0] < total:
                    token, token_logp = sample_tokens(logits, temperature, top_p)
                else:  # only the dummy row: nothing to sample (the random stream stays that of a rank alone)
                    token, token_logp = rows.new_full((1,), tokenizer.pad_token_id), logits.new_zeros(1)
                tokens[rows, t], logprobs[rows, t] = token, token_logp
                stopped = torch.isin(token, stop_ids) | self.stops(tokenizer, tokens, rows, t).to(device)
                ended = (stopped | (t + 1 >= limits[rows])) & (rows < total)
                lengths[rows[ended]], cut[rows[ended]] = t + 1, ~stopped[ended]
                running = ~ended & (rows < total)
                if self.enough(rows[ended]):
                    running[:] = False
                num_running = int(running.sum())  # the step's host sync
                go_on = torch.tensor(float(num_running > 0), device=device)
                if fsdp:  # every rank steps until every rank is done
                    go_on = accelerator.reduce(go_on, reduction="max")
                if not go_on:
                    break
                if num_running < len(rows):  # drop the finished rows from the batch and the cache
                    keep = running.nonzero().squeeze(1) if num_running else rows.new_zeros(1)
                    cache.batch_select_indices(keep)
                    rows = rows[keep] if num_running else rows.new_full((1,), total)
                    token, attention_mask, positions = token[keep], attention_mask[keep], positions[keep]
                input_ids, positions = token[:, None], positions[:, -1:] + 1
        lengths = torch.where(lengths > 0, lengths, t + 1)  # a row still running when decoding stopped (enough)
        return [Sample(ids[:length], lps[:length] if temperature > 0 else None, truncated) for ids, lps, length,
                truncated in zip(tokens[:total].tolist(), logprobs[:total].tolist(), lengths[:total].tolist(),
                                 cut[:total].tolist())]


def sample_tokens(logits, temperature, top_p):
    """One token per row from softmax(logits / T) restricted to the top-p nucleus, and its log-prob under that
    distribution (what vLLM's processed_logprobs reports); temperature 0 is greedy (log-prob 0). Inverse-CDF sampling
    in float64, one uniform per row: torch.multinomial draws one exponential per vocabulary entry (0.10 s of a 1.3 s
    toy step, cProfile)."""
    if temperature == 0:
        return logits.argmax(-1), torch.zeros(len(logits), device=logits.device)
    from transformers import TopPLogitsWarper

    scores = logits.float() / temperature if temperature != 1.0 else logits.float()  # x / 1.0 is x: skip it
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)  # tokens outside the nucleus get -inf
    logp = torch.log_softmax(scores, dim=-1)
    cdf = logp.exp().cumsum(-1, dtype=torch.float64)  # float64 sums: tail tokens of a 150k vocabulary keep their mass
    total = cdf[:, -1:]
    u = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    token = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # first index whose cdf exceeds u: probability > 0
    return token, logp.gather(-1, token[:, None]).squeeze(-1)
