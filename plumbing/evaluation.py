"""Held-out accuracy of the policy: pass@1 greedy and sampled, pass@k and the greedy format rate, over processes."""

import torch

from utils.rl import pass_at_k


def pass_rates(sample_texts, scorer, tokenizer, rows, accelerator, run, chunk_size=None):
    """pass@1 on this process's share of the test rows: greedy, and the mean over n = run.eval_samples samples
    (--eval_temperature, --eval_top_p); pass@k for k = 2, 4, ... <= n from the same samples (unbiased estimator); the
    greedy format rate; all reduced over processes. sample_texts(prompts, n, temperature, top_p) -> the texts of
    n * len(prompts) completions, each prompt's n consecutive (the script's own sampling, as for its rollouts).
    chunk_size: prompts per sample_texts call (None: all of them, one call)."""
    world = accelerator.num_processes  # every rank gets as many problems: as many sampling calls
    mine = rows[: min(run.eval_size, len(rows)) // world * world][accelerator.process_index::world]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in mine]
    ks = [2 ** i for i in range(1, run.eval_samples.bit_length())]  # 2, 4, ... up to eval_samples
    totals = torch.zeros(4 + len(ks), device=accelerator.device)  # greedy, sampled, problems, format, pass@k sums
    size = chunk_size or max(1, len(prompts))
    for start in range(0, len(prompts), size):
        chunk, chunk_rows = prompts[start:start + size], mine[start:start + size]
        for column, n, temperature in ((0, 1, 0.0), (1, run.eval_samples, run.eval_temperature)):
            texts = sample_texts(chunk, n, temperature, run.eval_top_p if temperature else 1.0)
            acc, formats, _ = scorer.result(scorer.submit(texts, [r for r in chunk_rows for _ in range(n)]))
            totals[column] += sum(acc) / n
            if column == 0:
                totals[3] += sum(formats)
            for j, k in enumerate(ks if column == 1 else []):  # each problem's n samples are consecutive
                totals[4 + j] += sum(pass_at_k(n, int(sum(acc[i:i + n])), k) for i in range(0, len(acc), n))
        totals[2] += len(chunk)
    totals = accelerator.reduce(totals, reduction="sum")
    n = totals[2].clamp(min=1)
    return {"eval/pass@1_greedy": (totals[0] / n).item(), f"eval/pass@1_sampled_k{run.eval_samples}":
            (totals[1] / n).item(), **{f"eval/pass@{k}": (totals[4 + j] / n).item() for j, k in enumerate(ks)},
            "eval/format_greedy": (totals[3] / n).item(), "eval/problems": int(totals[2].item())}
