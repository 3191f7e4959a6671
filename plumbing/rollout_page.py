"""The rollout page (--html_every N): <run>/rollouts/step_N.html, a static self-contained page (no script, no network)
of a few groups of one training step: the prompt, each completion's reward parts and advantage, and every completion
token coloured by the weight the loss gave its log-prob, with the token's numbers on hover. A script's loop calls
it through plumbing/run.py Run.page, with its rollout batch and what its update_policy returned: each micro-batch of
the last epoch as the loss took it.

The weight of token t is read from the script's own loss, whatever the algorithm:

    weight_t = -dL/d log pi_theta(o_t) * N

L: the micro-batch's share of its mini-batch's loss (the script's compute_loss, called again here on the log-probs
the step computed: the model is not involved); N: the mini-batch's trained tokens over all processes. Under a
token-mean loss weight_t is the advantage times the algorithm's ratio/clip/mask factor (GRPO's per-completion token
mean scales it by N / (B |o_i|)); a clipped or masked token's policy-gradient weight is 0 (grey on the page). The
script passes its loss as functions of the loss's inputs: "weight" (the whole loss) and, where the loss has a KL term,
"pg_weight" (the policy-gradient part alone; the difference is the KL term's). A loss that draws at random (Clip-Cov)
draws again here, from its own stream: the run's random state is left as it was."""

import functools
import html
import json
import os
import sys

import torch

DIGITS = 4  # significant digits of the numbers shown (the data block holds them in full)


def write_rollout_page(run_dir, step, tokenizer, batch, last_epoch, losses, prompts, rewards, truncated, group_size,
                       groups):
    """Write <run_dir>/rollouts/step_<step>.html for the last `groups` groups of this process's rollout batch -> its
    path. batch: the step's (input_ids, attention_mask, prompt_width, mask, engine_logp, advantages, ref_logp);
    last_epoch: the dicts update_policy returned (rows, logp, entropy, old_logp, advantages, counts: what compute_loss
    took; tis_weights where the script gives them to the loss apart from the advantages, clip_cov.py); losses:
    {"weight": f[, "pg_weight": f]}, each f(logp, old_logp, ref_logp, advantages, mask, counts[, tis_weights=]) ->
    (loss, ...); prompts (text), rewards ({part: value}), truncated: per row of the batch; group_size: completions per
    prompt."""
    first = len(batch.mask) - min(len(batch.mask), groups * group_size)
    recorded = {}
    for inputs in last_epoch:
        keep = [i for i, row in enumerate(inputs["rows"].tolist()) if row >= first]
        if keep:
            recorded.update(token_rows(batch, inputs, losses, keep))
    rows = [dict(row=r, prompt=prompts[r], truncated=bool(truncated[r]), **{k: float(v[r]) for k, v in
            rewards.items()}, **recorded[r]) for r in sorted(recorded)]
    for row in rows:
        row["text"] = [tokenizer.decode([t]) for t in row["token_id"]]
    path = os.path.join(run_dir, "rollouts", f"step_{step}.html")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(page_html(os.path.basename(sys.argv[0]), step, rows, list(rewards), group_size))
    os.replace(path + ".tmp", path)
    return path


def token_rows(batch, inputs, losses, keep):
    """{batch row: its per-token numbers} for the rows `keep` (positions in inputs["rows"]) of one micro-batch."""
    rows, logp, old_logp, advantages, counts = (inputs[k] for k in ("rows", "logp", "old_logp", "advantages",
                                                                    "counts"))
    width = logp.shape[1]
    mask, ref_logp = batch.mask[rows, :width], None if batch.ref_logp is None else batch.ref_logp[rows, :width]
    tis = {} if inputs.get("tis_weights") is None else {"tis_weights": inputs["tis_weights"]}
    with torch.random.fork_rng(devices=[]):  # a loss that draws (Clip-Cov) leaves the run's random stream alone
        weights = {name: token_weights(functools.partial(loss, **tis), logp, old_logp, ref_logp, advantages, mask,
                                       counts) for name, loss in losses.items()}
    weights.setdefault("pg_weight", weights["weight"])  # a loss without a KL term is all policy gradient
    num_seqs, num_tokens = (int(c) for c in counts)
    out = {}
    for i in keep:
        row = int(rows[i])
        length = int(batch.attention_mask[row, batch.prompt_width:].sum())  # the completion's tokens, tool output too
        per_token = {"token_id": batch.input_ids[row, batch.prompt_width:batch.prompt_width + length],
                     "mask": mask[i], "logp": logp[i], "old_logp": old_logp[i],
                     "engine_logp": batch.engine_logp[row, :width], "entropy": inputs["entropy"][i],
                     "advantage": batch.advantages[row, :width],
                     "advantage_used": advantages[i] * tis["tis_weights"][i] if tis else advantages[i],
                     **{name: w[i] for name, w in weights.items()}}
        if ref_logp is not None:
            per_token["ref_logp"] = ref_logp[i]
        out[row] = {"num_seqs": num_seqs, "num_tokens": num_tokens, **{
            name: value.detach()[:length].tolist() for name, value in per_token.items()}}
    return out


def token_weights(loss_function, logp, old_logp, ref_logp, advantages, mask, counts):
    """-dL/d logp * N, (B, T), through the loss on a detached copy of logp."""
    with torch.enable_grad():
        logp = logp.detach().requires_grad_()
        loss = loss_function(logp, old_logp, ref_logp, advantages, mask, counts)[0]
        (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return torch.zeros_like(logp) if grad is None else -grad * counts[1]


def token_flags(row, t):
    """The masks that applied to token t of a recorded row, as words."""
    flags = []
    if not row["mask"][t]:
        flags.append("not trained (mask 0): tool output" if any(row["mask"]) else
                     "not trained (mask 0): the whole completion left the loss (a filter)")
    elif row["advantage"][t] != 0 and row["advantage_used"][t] == 0:
        flags.append("advantage zeroed by the token weights (a TIS mask, the high-entropy selection)")
    elif row["advantage_used"][t] != 0 and row["pg_weight"][t] == 0:
        flags.append("no policy gradient: clipped (the ratio clip, or the loss's own selection: Clip-Cov)")
    return flags


def number(x):
    return f"{x:.{DIGITS}g}"


def token_title(row, t):
    """The hover text of token t: every quantity the loss used."""
    ratio = 2.718281828459045 ** (row["logp"][t] - row["old_logp"][t])
    weight_used = row["advantage_used"][t] / row["advantage"][t] if row["advantage"][t] else None
    lines = [f"{row['text'][t]!r} (id {row['token_id'][t]})",
             f"weight {number(row['weight'][t])} (policy gradient {number(row['pg_weight'][t])}, KL "
             f"{number(row['weight'][t] - row['pg_weight'][t])})",
             f"log pi_theta {number(row['logp'][t])}, log pi_old {number(row['old_logp'][t])}" +
             (f", log pi_ref {number(row['ref_logp'][t])}" if "ref_logp" in row else ""),
             f"engine log-prob {number(row['engine_logp'][t])}, gap "
             f"{number(abs(row['engine_logp'][t] - row['old_logp'][t]))}",
             f"ratio pi_theta / pi_old {number(ratio)}, entropy {number(row['entropy'][t])}",
             f"advantage {number(row['advantage'][t])}, in the loss {number(row['advantage_used'][t])}" +
             (f" (importance weight {number(weight_used)})" if weight_used is not None else "")]
    return "\n".join(lines + token_flags(row, t))


def token_style(row, t, scale):
    """Green for a positive weight, red for a negative one, the stronger the larger; grey when 0 or untrained."""
    w = row["weight"][t]
    if not row["mask"][t] or w == 0 or token_flags(row, t):
        return "background:#e4e4e4;color:#888"
    alpha = min(1.0, abs(w) / scale) * 0.85 + 0.15
    return f"background:rgba({'0,170,60' if w > 0 else '220,40,40'},{alpha:.2f})"


STYLE = """body{font-family:sans-serif;max-width:70em;margin:1em auto;color:#222}
.prompt{white-space:pre-wrap;background:#f4f4ff;padding:.5em;font-size:90%}
.completion{font-family:monospace;white-space:pre-wrap;line-height:1.6;margin:.3em 0 1em 0}
.completion span{border-radius:2px;border-right:1px solid #fff}table{border-collapse:collapse;font-size:90%}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"""


def page_html(script, step, rows, reward_parts, group_size):
    """The page: a section per group, a table of its completions, each completion's tokens coloured by weight."""
    scale = max([abs(w) for row in rows for w, m in zip(row["weight"], row["mask"]) if m] + [1e-12])
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{script} step {step}</title>"
           f"<style>{STYLE}</style></head><body><h1>{html.escape(script)}: step {step}</h1>",
           "<p>Each completion token is coloured by the weight the loss gave its log-prob, -dL/d log pi(token) "
           "times the mini-batch's token count: green pushes the token up, red down, grey gets no policy gradient "
           f"(clipped or masked). Full colour: |weight| {number(scale)}. Hover a token for its numbers. Rows as the "
           "loss saw them in the step's last epoch.</p>"]
    groups = {}
    for row in rows:
        groups.setdefault(row["row"] // group_size, []).append(row)
    for group, members in groups.items():
        out.append(f"<h2>group {group}</h2><div class='prompt'>{html.escape(members[0]['prompt'])}</div>")
        out.append("<table><tr><th>row</th>" + "".join(f"<th>{html.escape(p)}</th>" for p in reward_parts) +
                   "<th>advantage</th><th>tokens</th><th>truncated</th></tr>")
        for row in members:
            advantage = next((a for a, m in zip(row["advantage"], row["mask"]) if m), 0.0)
            out.append(f"<tr><td>{row['row']}</td>" + "".join(f"<td>{number(row[p])}</td>" for p in reward_parts) +
                       f"<td>{number(advantage)}</td><td>{len(row['text'])}</td><td>{row['truncated']}</td></tr>")
        out.append("</table>")
        for row in members:
            spans = "".join(f"<span style='{token_style(row, t, scale)}' title='{html.escape(token_title(row, t))}'>"
                            f"{html.escape(text)}</span>" for t, text in enumerate(row["text"]))
            out.append(f"<div class='completion' id='row{row['row']}'><b>{row['row']}:</b> {spans}</div>")
    # the numbers in full, for tools and tests: JSON, which the browser does not run ("</" escaped: the block cannot
    # end early)
    data = json.dumps({"script": script, "step": step, "group_size": group_size, "rows": rows}).replace("</", "<\\/")
    out.append(f"<script type='application/json' id='data'>{data}</script></body></html>")
    return "\n".join(out)
