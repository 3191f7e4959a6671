"""Partial rollouts (grpo_async.py): decoding that stops as soon as enough groups of completions are complete, the
running rows returned with the tokens they have so far, on the HF decode loop or through vLLM's request-level API
(add, step, abort). The engine is awake; the caller wakes it, puts it to sleep and keeps the carried groups."""

import time

import torch

from plumbing.engine import HFDecoder, Sample


class PartialDecoder(HFDecoder):
    """The HF decode loop for partial rollouts: each row its own token budget, and decoding stops as soon as
    groups_needed groups (a group id per row) have every row finished; `finished` says which rows ended."""

    def __init__(self, stop_ids, budgets, groups, groups_needed):
        super().__init__(stop_ids, budgets)
        self.groups_needed, self.group_of = groups_needed, torch.tensor(groups)
        self.rows_left = torch.bincount(self.group_of)  # rows still running per group; a group is complete at 0
        self.given = self.rows_left > 0  # an id without rows here (a group complete before) is never counted
        self.finished, self.decode_calls = torch.zeros(len(groups), dtype=torch.bool), 0

    def enough(self, ended):
        ended = ended.cpu()
        self.finished[ended] = True
        self.rows_left.index_add_(0, self.group_of[ended], -torch.ones_like(ended))
        self.decode_calls += 1
        return int(((self.rows_left == 0) & self.given).sum()) >= self.groups_needed


def decode_partial(engine, model, tokenizer, prefixes, budgets, groups, groups_needed, temperature, top_p,
                   accelerator, fallback):
    """Continue each row from its prefix (prompt + its tokens so far) within its budget, until groups_needed groups
    (groups: a group id per row) are complete -> (a Sample per row, whether each row finished, decode calls of the
    HF loop or engine steps of vLLM). fallback: [a prompt] for a rank with no rows (every rank decodes while any
    does)."""
    if engine.llm is None:
        decoder = PartialDecoder(engine.stop_ids, budgets, groups, groups_needed)
        samples = decoder.generate(model, tokenizer, prefixes or fallback, 1, temperature, top_p,
                                   max(budgets, default=1), accelerator)[:len(prefixes)]
        return samples, decoder.finished.tolist(), decoder.decode_calls
    from vllm import SamplingParams

    rows_left, call = [0] * (max(groups, default=0) + 1), f"p{time.monotonic_ns()}"  # request ids: call-row
    for i, (group, prefix, budget) in enumerate(zip(groups, prefixes, budgets)):
        rows_left[group] += 1
        engine.llm.llm_engine.add_request(f"{call}-{i}", {"prompt_token_ids": prefix}, SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=budget, logprobs=0, stop_token_ids=engine.stop_ids))
    latest, calls, complete = {}, 0, 0
    while engine.llm.llm_engine.has_unfinished_requests() and complete < groups_needed:
        calls += 1
        for out in engine.llm.llm_engine.step():  # cumulative: each output holds all of its request's tokens
            i = int(out.request_id.rsplit("-", 1)[1])
            latest[i] = out.outputs[0]
            if out.finished:
                rows_left[groups[i]] -= 1
                complete += rows_left[groups[i]] == 0
    engine.llm.llm_engine.abort_request([f"{call}-{i}" for i in range(len(prefixes))
                                         if i not in latest or latest[i].finish_reason is None])
    outputs = [latest.get(i) for i in range(len(prefixes))]  # a request never stepped has no tokens yet
    samples = [Sample(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)],
                      o.finish_reason == "length") if o else Sample([], [], False) for o in outputs]
    return samples, [o is not None and o.finish_reason is not None for o in outputs], calls
