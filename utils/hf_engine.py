"""The HF rollout engine, for CPUs and runs without vLLM: a decode loop over the policy's own forward pass and KV
cache that samples as vLLM does (tempered top-p nucleus, the log-prob of each drawn token under that distribution).
The algorithm scripts call hf_generate when no vLLM engine runs; their vLLM path (wake, push, generate, sleep) is in
each script, beside it."""

from typing import NamedTuple, Optional

import torch


class Sample(NamedTuple):
    """One sampled completion, from either engine."""
    token_ids: list  # the completion's tokens, its stop token included when it has one
    logprobs: Optional[list]  # the engine's log-prob of each token; None for greedy decoding
    truncated: bool  # it ran out of max_new_tokens before a stop token
    finished: bool = True  # False: stopped early (hf_generate's groups_needed) and to be continued later


@torch.no_grad()
def hf_generate(model, tokenizer, prompts, n, temperature, top_p, max_new_tokens, accelerator, stop_ids,
                budgets=None, groups=None, groups_needed=None, stats=None, stop_strings=()):
    """Decode with the policy's forward pass and KV cache: each prompt prefilled once for its n completions, finished
    rows dropped from the batch, so a step costs the completions still running (2.1x faster than transformers'
    generate() on the toy: benchmarks/hf_decode.py). Under FSDP every rank runs every forward pass: a finished rank
    keeps a dummy row. A completion ends at its first token in stop_ids. Returns n * len(prompts) Samples, the n
    completions of each prompt together.

    For partial rollouts (grpo_async.py): budgets gives each output row its own token limit (a continued completion
    has fewer tokens left; default max_new_tokens); with groups (a group id per output row) and groups_needed, decoding
    stops as soon as that many groups have every row finished, and the other rows come back with the tokens they
    have and finished=False. A dict `stats` gets "decode_calls", the forward passes run. stop_strings end a completion
    whose decoded text reaches one, as vLLM's stop strings do (grpo_tools.py: the end of a code block); its tokens are
    kept."""
    from transformers import DynamicCache

    unwrapped, device, total = accelerator.unwrap_model(model), accelerator.device, len(prompts) * n
    inputs = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt").to(device)
    prompt_width, stop_tensor = inputs["input_ids"].shape[1], torch.tensor(stop_ids, device=device)
    positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    attention_mask = torch.cat([inputs["attention_mask"], positions.new_ones(len(prompts), max_new_tokens)], dim=1)
    synced = accelerator.distributed_type == "FSDP"  # a str enum
    tokens = torch.full((total + 1, max_new_tokens), tokenizer.pad_token_id, device=device)  # row `total`: dummy's
    logprobs = torch.zeros(total + 1, max_new_tokens, device=device)
    lengths = torch.full((total + 1,), -1, device=device)  # set when a row ends (stop token or budget), else -1
    cut = torch.zeros(total + 1, dtype=torch.bool, device=device)  # ended by its budget, not by a stop token or string
    stop_width = max(map(len, stop_strings), default=0)  # every token decodes to >= 1 character: enough tokens
    budget = torch.tensor([*(budgets or [max_new_tokens] * total), max_new_tokens], device=device)
    if groups_needed:  # rows still running per group; a group is complete at 0
        group_of = torch.tensor([*groups, -1], device=device)
        rows_left = torch.bincount(group_of[:total], minlength=int(group_of.max()) + 1)
        given = rows_left > 0  # an id without rows here (a caller's group finished before) is never counted
    rows = torch.arange(total, device=device)  # the output row of each batch row
    cache, input_ids, t = DynamicCache(config=unwrapped.config), inputs["input_ids"], 0
    with torch.inference_mode(not synced):  # cheaper than no_grad; FSDP2 must not gather weights as inference tensors
        for t in range(max_new_tokens):
            logits = unwrapped(input_ids=input_ids, attention_mask=attention_mask[:, :prompt_width + t],
                               position_ids=positions, past_key_values=cache, use_cache=True,
                               logits_to_keep=1).logits[:, -1]
            if t == 0 and n > 1:  # each prompt was prefilled once: its cache and logits serve its n completions
                cache.batch_repeat_interleave(n)
                logits, attention_mask, positions = (x.repeat_interleave(n, dim=0) for x in (logits, attention_mask,
                                                                                              positions))
            token, token_logp = sample_tokens(logits, temperature, top_p) if temperature > 0 else (
                logits.argmax(-1), torch.zeros(len(logits), device=device))
            tokens[rows, t], logprobs[rows, t] = token, token_logp
            stopped = torch.isin(token, stop_tensor)
            if stop_strings:  # only the newest tokens can complete one: an earlier one would have ended the row
                tails = tokenizer.batch_decode(tokens[rows, max(0, t + 1 - stop_width):t + 1].tolist())
                stopped |= torch.tensor([any(s in tail for s in stop_strings) for tail in tails], device=device)
            ended = (stopped | (t + 1 >= budget[rows])) & (rows < total)
            lengths[rows[ended]], cut[rows[ended]] = t + 1, ~stopped[ended]
            running = ~ended & (rows < total)
            if groups_needed:
                rows_left.index_add_(0, group_of[rows[ended]], -torch.ones_like(rows[ended]))
                if int(((rows_left == 0) & given).sum()) >= groups_needed:  # enough whole groups: the rest waits
                    running = torch.zeros_like(running)
            num_running = int(running.sum())  # the host sync of the step
            go_on = num_running > 0
            if synced:  # every rank steps until all ranks are done
                go_on = accelerator.reduce(torch.tensor(float(go_on), device=device), reduction="max").item() > 0
            if not go_on:
                break
            if num_running < len(rows):  # drop finished rows from the batch and the cache
                keep = running.nonzero().squeeze(1) if num_running else rows.new_zeros(1)
                cache.batch_select_indices(keep)
                rows = rows[keep] if num_running else rows.new_full((1,), total)
                token, attention_mask, positions = token[keep], attention_mask[keep], positions[keep]
            input_ids, positions = token[:, None], positions[:, -1:] + 1
    if stats is not None:
        stats["decode_calls"] = t + 1
    finished = lengths[:total] >= 0
    lengths = torch.where(finished, lengths[:total], t + 1)  # an unfinished row has every step's token
    return [Sample(ids[:length], lps[:length] if temperature > 0 else None, truncated, done) for ids, lps, length,
            truncated, done in zip(tokens[:total].tolist(), logprobs[:total].tolist(), lengths.tolist(),
                                   cut[:total].tolist(), finished.tolist())]


def sample_tokens(logits, temperature, top_p):
    """One token per row from softmax(logits / T) restricted to the top-p nucleus, and its log-prob under that
    distribution (what vLLM's processed_logprobs reports). Inverse-CDF sampling in float64, one uniform per row:
    torch.multinomial draws one exponential per vocabulary entry (0.10 s of a 1.3 s toy step, cProfile)."""
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
