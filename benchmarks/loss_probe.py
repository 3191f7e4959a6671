"""Every algorithm's loss on one batch: what each does differently from GRPO, measured on the same tokens.

One real rollout batch (the policy's own samples, scored by the task's verifier); the policy then takes --moves GRPO
optimizer steps on it (grpo.py's own update_policy, as the later mini-batches of an epoch), so that pi_theta differs
from pi_old and clipping can act. On that batch and that policy, each algorithm file's own compute_advantages and
compute_loss (imported from the script, with its defaults) give:

- the per-token weight the loss puts on each log-prob, -dL/dlogp * N (plumbing/rollout_page.token_weights), and its
  cosine with GRPO's;
- the gradient over every parameter: its cosine with GRPO's and its norm over GRPO's;
- the share of tokens whose policy-gradient weight is 0 (clipped or masked), among tokens of positive and of negative
  advantage (each algorithm's own advantage).

ppo.py is left out (its advantages come from a critic trained along the run, not from this batch alone), and
grpo_async.py and grpo_tools.py have grpo.py's loss.

    python benchmarks/loss_probe.py                                   # the toy (seconds)
    python benchmarks/loss_probe.py --model smollm2-135m --task rg:chain_sum:min_terms=2,max_terms=3,min_digits=1,\
        max_digits=1 --instruction user --prompts 8 --max_new_tokens 64 --learning_rate 1e-5 --name loss_probe_smollm2
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grpo import make_batch, micro_batches  # noqa: E402
from plumbing.models import for_training, load_model  # noqa: E402
from plumbing.parallel import make_accelerator  # noqa: E402
from plumbing.engine import Engine  # noqa: E402
from utils.rl import kl_k1, masked_whiten  # noqa: E402
from plumbing.rollout_page import token_weights  # noqa: E402

ALGORITHMS = {  # name: (script, Args fields changed from the script's defaults)
    "grpo": ("grpo.py", {}),
    "dr_grpo": ("dr_grpo.py", {}),
    "lite_ppo": ("lite_ppo.py", {}),
    "gdpo": ("gdpo.py", {}),
    "grpo_kl": ("grpo_kl.py", {}),
    "dapo": ("dapo.py", {}),
    "gspo": ("gspo.py", {}),
    "cispo": ("cispo.py", {}),
    "aspo": ("aspo.py", {}),
    "high_entropy": ("high_entropy.py", {}),
    "clip_cov": ("clip_cov.py", {}),
    "kl_cov": ("clip_cov.py", {"method": "kl_cov"}),
    "reinforce_pp": ("reinforce_pp.py", {}),
    "reinforce_pp_baseline": ("reinforce_pp.py", {"baseline": True}),
}


def load_script(script):
    """An algorithm file as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(script)[0], os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_advantages(module, args, rollout, accelerator):
    """(B, T) advantages as the script's training loop and update_policy hand them to compute_loss: its own
    compute_advantages, and the per-token factors some scripts fold in (named after the script). A token's sign
    class (A > 0, A < 0) is read from these before high_entropy.py's mask, which probe applies."""
    batch, rewards, parts = rollout["batch"], rollout["rewards"], rollout["parts"]
    name = module.__name__
    if name == "gdpo":
        return module.compute_advantages(parts, args)[:, None] * batch.mask
    if name == "reinforce_pp":  # the KL in the reward (k1 of pi_old, before the moves), whitened over the tokens
        kl = kl_k1(rollout["old_logp"], rollout["ref_logp"]) if args.beta > 0 and not args.baseline else None
        returns = module.compute_advantages(rewards, batch.mask, kl, args)
        return masked_whiten(returns, batch.mask, unbiased=args.whiten_unbiased, eps=args.adv_eps) * batch.mask
    advantages = module.compute_advantages(rewards, args)
    if name == "dapo" and args.loss_agg == "group-token-mean":
        advantages = advantages * module.group_token_weights(batch.mask, args.num_generations)
    return advantages[:, None] * batch.mask


def loss_gradient(module, args, rollout, advantages, policy, accelerator, micro_batch_size):
    """The script's loss on the batch at the moved policy, the batch as one mini-batch -> (flat parameter gradient,
    per-token weights -dL/dlogp * N (B, T))."""
    batch = rollout["batch"]
    beta = getattr(args, "beta", 0.0)
    counts = (len(batch), batch.mask.sum())
    weights = torch.zeros_like(batch.mask)
    policy.zero_grad(set_to_none=True)
    for rows, mc in micro_batches(batch, micro_batch_size):
        logp, _ = module.token_logprobs(policy, mc, args.temperature, accelerator)
        width = logp.shape[1]
        old, ref, adv = (x[rows, :width] for x in (rollout["old_logp"], rollout["ref_logp"], advantages))
        module.compute_loss(logp, old, ref if beta else None, adv, mc.mask, counts, args)[0].backward()
        weights[rows, :width] = token_weights(lambda *inputs: module.compute_loss(*inputs, args), logp, old,
                                              ref if beta else None, adv, mc.mask, counts)
    gradient = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
    policy.zero_grad(set_to_none=True)
    return gradient, weights


def probe(module, args, rollout, policy, accelerator, micro_batch_size):
    """-> (the policy-gradient terms' flat gradient and per-token weights (beta = 0), the KL term's gradient norm
    (0 without one), the algorithm's advantages (B, T), before high_entropy.py's mask)."""
    advantages = trained = script_advantages(module, args, rollout, accelerator)
    if module.__name__ == "high_entropy":  # the policy gradient of the top tokens by pi_old's entropy (one mini-batch)
        threshold = module.entropy_threshold(rollout["old_entropy"], rollout["batch"].mask, args.top_entropy_frac,
                                             accelerator)
        trained = advantages * (rollout["old_entropy"] >= threshold).float()
    pg_args = dataclasses.replace(args, beta=0.0) if getattr(args, "beta", 0.0) else args
    gradient, weights = loss_gradient(module, pg_args, rollout, trained, policy, accelerator, micro_batch_size)
    kl_norm = 0.0
    if pg_args is not args:  # the whole loss's gradient less the policy-gradient terms' is the KL term's
        whole, _ = loss_gradient(module, args, rollout, trained, policy, accelerator, micro_batch_size)
        kl_norm = float((whole - gradient).double().norm())
    return gradient, weights, kl_norm, advantages


def collect_rollout(args, prompts_count, moves, seed):
    """One rollout batch from grpo.py's own pieces, its pi_old, pi_ref and entropies; then `moves` GRPO optimizer
    steps on it. -> (rollout dict, the moved policy, accelerator, grpo module)."""
    from accelerate.utils import set_seed

    from plumbing.models import load_tokenizer
    from utils.rewards import RewardScorer
    from utils.tasks import load_splits

    grpo = load_script("grpo.py")
    accelerator = make_accelerator()
    set_seed(seed)
    tokenizer, stop_ids = load_tokenizer(args.model)
    train_rows, _, _ = load_splits(args.task, tokenizer, args.answer_format, args.instruction, args.max_prompt_length,
                                   1, prompts_count, 0)
    policy = for_training(load_model(args.model, tokenizer), args.run, args.model)
    policy.eval()  # dropout off, as in the scripts
    ref = load_model(args.model, tokenizer)
    picks = np.random.default_rng([seed, 0]).choice(len(train_rows), prompts_count, replace=False)
    rows = [train_rows[i] for i in picks]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    G = args.num_generations
    samples, _ = grpo.generate(Engine(stop_ids), policy, tokenizer, prompts, G, args.temperature, args.top_p,
                               args.max_new_tokens, accelerator, policy_version=0)
    texts = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
    scorer = RewardScorer(args.task, args.answer_format, 1, 5.0, 1024)
    accuracy, formats, _ = scorer.result(scorer.submit(texts, [r for r in rows for _ in range(G)]))
    scorer.close()
    rewards = torch.tensor(accuracy) + args.format_reward_weight * torch.tensor(formats)
    batch = make_batch([p for p in prompts for _ in range(G)], samples, tokenizer.pad_token_id, accelerator.device)
    size = len(batch)
    old_logp, old_entropy = torch.zeros_like(batch.mask), torch.zeros_like(batch.mask)
    with torch.no_grad():
        for rows_, mc in micro_batches(batch, args.micro_batch_size):
            logp, entropy = grpo.token_logprobs(policy, mc, args.temperature, accelerator, with_entropy=True)
            old_logp[rows_, :logp.shape[1]], old_entropy[rows_, :logp.shape[1]] = logp, entropy
    ref_logp = grpo.batched_logprobs(ref, batch, args.temperature, accelerator, size, args.micro_batch_size)
    del ref
    # the policy moves: `moves` GRPO optimizer steps on this batch (grpo.py's update_policy, mini-batches of it)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=0.0)
    if moves:
        moved = dataclasses.replace(batch, old_logp=old_logp, ref_logp=ref_logp,
                                    advantages=grpo.compute_advantages(rewards, args)[:, None] * batch.mask)
        move_args = dataclasses.replace(args, num_minibatches=moves, micro_batch_size=min(args.micro_batch_size,
                                                                                             size // moves))
        grpo.update_policy(move_args, policy, optimizer, moved, accelerator)
    rollout = {"batch": batch, "rewards": rewards, "parts": torch.tensor([accuracy, formats]).T.float(),
               "old_logp": old_logp, "ref_logp": ref_logp, "old_entropy": old_entropy}
    return rollout, policy, accelerator, grpo


def cosine(x, y):
    """Cosine of two flat tensors in float64; NaN when either is 0 (a loss whose every token is clipped)."""
    x, y = x.double(), y.double()
    denominator = float(x.norm() * y.norm())
    return float(x @ y) / denominator if denominator else float("nan")


def share(values):
    return float(values.float().mean()) if values.numel() else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="grpo.py's --model (default: the embedded toy)")
    parser.add_argument("--task", default="toy")
    parser.add_argument("--instruction", default="system", choices=["system", "user"])
    parser.add_argument("--prompts", type=int, default=32, help="prompts in the batch (each with 8 completions)")
    parser.add_argument("--max_new_tokens", type=int, default=None)
    parser.add_argument("--moves", type=int, default=2, help="GRPO optimizer steps on the batch before the probe")
    parser.add_argument("--learning_rate", type=float, default=None, help="of those steps (default: grpo.py's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default=None, help="results file name (default: loss_probe_<task>)")
    parser.add_argument("--out", default=None, help="write <out>.md, .jsonl, .png there instead of benchmarks/results")
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    start = time.time()
    grpo = load_script("grpo.py")
    fields = {"task": cli.task, "instruction": cli.instruction, "prompts_per_step": cli.prompts, "seed": cli.seed,
              "learning_rate": cli.learning_rate, "max_new_tokens": cli.max_new_tokens,
              **({"model": cli.model} if cli.model else {})}
    args = grpo.resolve_args(grpo.Args(**fields), 1)
    rollout, policy, accelerator, grpo = collect_rollout(args, cli.prompts, cli.moves, cli.seed)
    mask = rollout["batch"].mask.bool()
    results, base = [], None
    for name, (script, changes) in ALGORITHMS.items():
        module = grpo if script == "grpo.py" else load_script(script)
        kept = {f.name for f in dataclasses.fields(module.Args)} & set(fields) - {"learning_rate", "max_new_tokens"}
        algo_args = dataclasses.replace(module.Args(**{k: fields[k] for k in kept}, **changes),
                                        learning_rate=args.learning_rate, max_new_tokens=args.max_new_tokens,
                                        model=args.model, answer_format=args.answer_format)
        gradient, weights, kl_norm, advantages = probe(module, algo_args, rollout, policy, accelerator,
                                                       args.micro_batch_size)
        if base is None:
            base = (gradient.clone(), weights.clone())
            with torch.no_grad():
                logp = grpo.batched_logprobs(policy, rollout["batch"], args.temperature, accelerator, len(mask),
                                             args.micro_batch_size)
            ratio = (logp - rollout["old_logp"]).exp()
        positive, negative = mask & (advantages > 0), mask & (advantages < 0)
        norm = float(gradient.double().norm())  # float64: a float32 dot product over 1e8 entries is off by percents
        results.append({
            "algorithm": name, "script": script, "grad_cosine": cosine(gradient, base[0]),
            "grad_norm_ratio": norm / float(base[0].double().norm()),
            "weight_cosine": cosine(weights[mask], base[1][mask]),
            "zero_pg_share_pos": share(weights[positive] == 0), "zero_pg_share_neg": share(weights[negative] == 0),
            "mean_weight_pos": float(weights[positive].mean()) if positive.any() else float("nan"),
            "mean_weight_neg": float(weights[negative].mean()) if negative.any() else float("nan"),
            "kl_over_pg_norm": kl_norm / norm if norm else float("inf") if kl_norm else 0.0,
            "tokens_pos": int(positive.sum()), "tokens_neg": int(negative.sum())})
        print(json.dumps(results[-1]))
    r = ratio[mask]
    context = {"model": os.path.basename(str(args.model)), "task": cli.task, "completions": len(mask),
               "tokens": int(mask.sum()), "reward_mean": float(rollout["rewards"].mean()),
               "moves": cli.moves, "learning_rate": args.learning_rate,
               "ratio_dev_median": float((r - 1).abs().median()), "ratio_dev_max": float((r - 1).abs().max()),
               "outside_clip_0.2": share((r - 1).abs() > 0.2), "seconds": time.time() - start}
    write_results(cli, context, results)


def write_results(cli, context, results):
    name = cli.name or f"loss_probe_{cli.task}"
    path = cli.out or os.path.join(ROOT, "benchmarks", "results", name)
    argv = sys.argv[1:]
    if cli.out:
        argv = argv[:argv.index("--out")] + argv[argv.index("--out") + 2:]
    command = "python benchmarks/loss_probe.py " + " ".join(argv)
    lines = [f"# {name}", "", f"Command: `{command.strip()}`", "",
             f"{context['completions']} completions ({context['tokens']} tokens) of {context['model']} on "
             f"{context['task']}, mean reward {context['reward_mean']:.3f}; the policy then took {context['moves']} "
             f"GRPO optimizer steps on them (lr {context['learning_rate']:g}): |pi_theta/pi_old - 1| median "
             f"{context['ratio_dev_median']:.2e}, max {context['ratio_dev_max']:.2e}, outside [0.8, 1.2]: "
             f"{context['outside_clip_0.2']:.2%} of the tokens. {context['seconds']:.0f} s in all.", "",
             "The policy-gradient terms (the loss with beta = 0) against GRPO's; the KL term's gradient apart, as a "
             "multiple of the policy-gradient terms' norm (its own column).", "",
             "| algorithm | gradient cosine vs GRPO | gradient norm / GRPO's | token-weight cosine vs GRPO | "
             "no policy gradient, A > 0 | no policy gradient, A < 0 | mean weight, A > 0 | mean weight, A < 0 | "
             "KL gradient norm / policy gradient's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        kl = f"{r['kl_over_pg_norm']:.3g}" if r["kl_over_pg_norm"] else "-"
        lines.append(f"| {r['algorithm']} | {r['grad_cosine']:.3f} | {r['grad_norm_ratio']:.3f} | "
                     f"{r['weight_cosine']:.3f} | {r['zero_pg_share_pos']:.2%} | {r['zero_pg_share_neg']:.2%} | "
                     f"{r['mean_weight_pos']:.3f} | {r['mean_weight_neg']:.3f} | {kl} |")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path + ".jsonl", "w") as f:
        for r in [context, *results]:
            f.write(json.dumps(r) + "\n")
    print("\n".join(lines))
    plot(path, context, results)


def plot(path, context, results):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    names = [r["algorithm"] for r in results]
    y = np.arange(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(14, 0.35 * len(names) + 1.5), sharey=True)
    axes[0].barh(y, [r["grad_cosine"] for r in results], color="tab:blue")
    axes[0].set_xlabel("gradient cosine vs GRPO")
    axes[1].barh(y, [r["grad_norm_ratio"] for r in results], color="tab:gray")
    axes[1].set_xlabel("gradient norm / GRPO's")
    axes[2].barh(y - 0.2, [r["zero_pg_share_pos"] for r in results], 0.4, label="A > 0", color="tab:green")
    axes[2].barh(y + 0.2, [r["zero_pg_share_neg"] for r in results], 0.4, label="A < 0", color="tab:red")
    axes[2].set_xlabel("tokens with no policy gradient")
    axes[2].legend()
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    fig.suptitle(f"Every loss on one batch: {context['model']} on {context['task']}, after {context['moves']} GRPO "
                 "steps")
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=100)


if __name__ == "__main__":
    main()
