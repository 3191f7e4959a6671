"""A script's held-out evaluation (Evaluation, which its main() calls at every step): the policy's pass@1 greedy and
sampled, pass@k and the greedy format rate over processes (pass_rates), and the calibration of the probabilities its
greedy completions state, where they state one (calibration_metrics); and what training changed beyond its task
(Tracking): other tasks' accuracy and the forward KL to the initial policy."""

import os
import re
import time

import numpy as np
import torch

from plumbing.engine import Sample
from utils.rewards import EXTRACTORS, RewardScorer, stated_confidence
from utils.rl import pass_at_k
from utils.tasks import TOY_TASKS, load_task


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
    statements = []  # each greedy completion's stated probability (nan: none), abstention, correctness
    size = chunk_size or max(1, len(prompts))
    for start in range(0, len(prompts), size):
        chunk, chunk_rows = prompts[start:start + size], mine[start:start + size]
        for column, n, temperature in ((0, 1, 0.0), (1, run.eval_samples, run.eval_temperature)):
            texts = sample_texts(chunk, n, temperature, run.eval_top_p if temperature else 1.0)
            acc, formats, _ = scorer.result(scorer.submit(texts, [r for r in chunk_rows for _ in range(n)]))
            totals[column] += sum(acc) / n
            if column == 0:
                totals[3] += sum(formats)
                for text, right in zip(texts, acc):
                    q, kind = stated_confidence(text, scorer.extract)
                    statements.append((np.nan if q is None else q, kind == "abstained", right))
            for j, k in enumerate(ks if column == 1 else []):  # each problem's n samples are consecutive
                totals[4 + j] += sum(pass_at_k(n, int(sum(acc[i:i + n])), k) for i in range(0, len(acc), n))
        totals[2] += len(chunk)
    totals = accelerator.reduce(totals, reduction="sum")
    n = totals[2].clamp(min=1)
    return {"eval/pass@1_greedy": (totals[0] / n).item(), f"eval/pass@1_sampled_k{run.eval_samples}":
            (totals[1] / n).item(), **{f"eval/pass@{k}": (totals[4 + j] / n).item() for j, k in enumerate(ks)},
            "eval/format_greedy": (totals[3] / n).item(), "eval/problems": int(totals[2].item()),
            **calibration(statements, accelerator, run.eval_risk_threshold)}


def calibration(statements, accelerator, threshold):
    """calibration_metrics as eval/calibration/<name> over every process's greedy completions ((q, abstained,
    correct) each), where any of them states a probability; else {} (a run whose format carries none logs none)."""
    local = torch.tensor(statements, dtype=torch.float64, device=accelerator.device).reshape(-1, 3)
    q, abstained, correct = accelerator.gather(local).cpu().numpy().T  # as many completions on every process
    if np.isnan(q).all():
        return {}
    return {f"eval/calibration/{k}": v for k, v in calibration_metrics(q, abstained > 0, correct, threshold).items()}


RISK_GRID = tuple(i / 10 for i in range(10))  # the risk thresholds eval/calibration/log_ahr_gain averages over
ECE_BINS = 10


def calibration_metrics(q, abstained, correct, threshold):
    """The calibration of stated probabilities (arXiv 2512.19920; 2507.16806), one completion per problem: q (n,) the
    probability each states that its answer is correct (nan: none, an abstention's too), abstained (n,) bool (IDK as
    the answer), correct (n,) 0/1 -> {name: float}:
    - stated_frac: the completions that state a probability; over them: confidence_mean, the mean q; ece, the
      expected calibration error over ECE_BINS equal-width bins of q ([0, 0.1), ..., [0.9, 1]):
      sum_b |sum_{i in b} (c_i - q_i)| / (completions stating one); brier, the mean (q - c)^2; auroc, the probability
      that a right answer states a higher q than a wrong one, ties half (nan unless both occur);
    - at the user's risk threshold t (2512.19920's behavior: answer when q >= t, else abstain): abstention, IDK or
      q < t; accuracy, answered and right; hallucination, answered and wrong; each over all n (a completion that
      states no probability answers); ahr, the Accuracy-to-Hallucination Ratio accuracy / hallucination (nan
      without a hallucination);
    - log_ahr_gain: the mean of ln AHR(t) - ln AHR(0) over the thresholds t in RISK_GRID at which some completion
      answers (where all abstain there is no ratio), the gain over answering whatever the confidence; each AHR from
      the counts plus one (finite where no answer is wrong)."""
    q, correct = np.asarray(q, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    abstained = np.asarray(abstained, dtype=bool)
    stated = ~np.isnan(q) & ~abstained
    qs, cs = q[stated], correct[stated]
    bins = np.minimum(np.floor(qs * ECE_BINS + 1e-9).astype(int), ECE_BINS - 1)  # q = 0.3 in [0.3, 0.4)
    right, wrong = qs[cs == 1], qs[cs == 0]
    pairs = len(right) * len(wrong)
    auroc = ((right[:, None] > wrong).sum() + 0.5 * (right[:, None] == wrong).sum()) / pairs if pairs else np.nan

    def answered(t):
        return ~abstained & ~(q < t)  # (nan < t is False: no stated probability, no abstention)

    def counts_ratio(t):  # (answered and right + 1) / (answered and wrong + 1)
        return ((answered(t) & (correct == 1)).sum() + 1) / ((answered(t) & (correct == 0)).sum() + 1)

    at = answered(threshold)
    accuracy, hallucination = (at & (correct == 1)).mean(), (at & (correct == 0)).mean()
    return {name: float(value) for name, value in {
            "stated_frac": stated.mean(), "confidence_mean": qs.mean() if len(qs) else np.nan,
            "ece": sum(abs((cs - qs)[bins == b].sum()) for b in range(ECE_BINS)) / len(qs) if len(qs) else np.nan,
            "brier": ((qs - cs) ** 2).mean() if len(qs) else np.nan, "auroc": float(auroc),
            "accuracy": accuracy, "hallucination": hallucination, "abstention": 1 - at.mean(),
            "ahr": accuracy / hallucination if hallucination else np.nan,
            "log_ahr_gain": np.mean([np.log(counts_ratio(t) / counts_ratio(0.0)) for t in RISK_GRID
                                     if answered(t).any()] or [np.nan])}.items()}


def prior_task_name(task):
    """The metric-key name of a --prior_tasks entry: rg:chain_sum:min_terms=2 -> rg-chain_sum-min_terms-2."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", os.path.basename(task.rstrip("/"))).strip("-")


def check_prior_tasks(tasks):
    """Distinct metric names (two configurations of one task must differ in their options, which the name keeps)."""
    names = [prior_task_name(task) for task in tasks]
    if len(set(names)) < len(names):
        raise ValueError(f"--prior_tasks {' '.join(tasks)}: two of them would log under one name; give distinct tasks")


class Tracking:
    """What training changed beyond its task, measured at every evaluation (RL's Razor, arXiv 2509.04259, measures
    forgetting as accuracy lost on prior tasks, and finds it predicted by the forward KL on the new task):

    - prior/<task>/...: for each --prior_tasks task, greedy pass@1 on its first --prior_eval_size test problems as its
      reward checks it (pass@1_greedy, format_greedy), and leniently (pass@1_lenient: the last number where the
      asked-for form is missing, lm-evaluation-harness's flexible extract): an untrained model answers in its own form
      ("4 + 7 = 11"), and what it can compute is what training may take away.
    - eval/forward_kl: KL(pi_0 || pi_theta) = E_{x, y ~ pi_0}[log pi_0(y|x) - log pi_theta(y|x)] in nats per
      completion, on the first --kl_prompts test prompts of the training task, one completion each sampled from the
      initial policy pi_0 at --temperature at the run's start (kept in the run's folder, so a resumed run measures
      against the same samples); the Monte Carlo estimate is unbiased and can come out below 0. eval/forward_kl_token
      divides by the completions' tokens.
    """

    def __init__(self, tasks, run, tokenizer, answer_format, instruction, max_prompt_length):
        self.run, self.prior, self.kl = run, [], None
        for task in tasks:
            task_format = "answer_tags" if task in TOY_TASKS else answer_format
            rows, _ = load_task(task, "test", tokenizer, task_format, max_prompt_length, run.prior_eval_size,
                                instruction)
            scorer = RewardScorer(task, task_format, 1, run.reward_timeout, run.reward_memory_mb, lenient=True)
            self.prior.append((prior_task_name(task), rows[:run.prior_eval_size], EXTRACTORS[task_format], scorer))

    def start_kl(self, path, resumed, rows, tokenizer, sample, sequence_logprobs, accelerator):
        """This process's share of the first --kl_prompts test rows, a completion of each sampled from the initial
        policy by sample(prompts) -> (Samples, masks: per completion a 0/1 list, 1 on the policy's own tokens, or
        None), and its log-probs (sequence_logprobs(prompts, samples, masks) -> (sums, token counts)), saved at
        `path`; a resumed run reads them there (pi_0 is gone), or, if any process finds none, measures no KL."""
        world = accelerator.num_processes
        mine = rows[:min(self.run.kl_prompts, len(rows)) // world * world][accelerator.process_index::world]
        if resumed:
            found = accelerator.reduce(torch.tensor(float(os.path.exists(path)), device=accelerator.device), "sum")
            if found.item() == world:
                self.kl = torch.load(path)
            else:
                accelerator.print(f"forward KL off: {path} holds no samples of the initial policy (the run started "
                                  "without them)")
        elif mine:
            prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in mine]
            # the run's own random stream is left as it was: with or without the KL, a run trains alike (a vLLM
            # engine's stream is its own, and moves)
            with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []):
                drawn = sample(prompts)
            samples, masks = drawn  # masks: grpo_tools.py's, 1 on the model's own tokens (tool output is context)
            self.kl = {"prompts": prompts, "completions": [s.token_ids for s in samples], "masks": masks}
            self.kl["base"] = self._logprobs(sequence_logprobs)[0].cpu()
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(self.kl, path + ".tmp")
            os.replace(path + ".tmp", path)

    def _logprobs(self, sequence_logprobs):
        samples = [Sample(ids, None, False) for ids in self.kl["completions"]]
        return sequence_logprobs(self.kl["prompts"], samples, self.kl["masks"])

    def evaluate(self, sample_texts, sequence_logprobs, tokenizer, accelerator, chunk_size=None):
        """The metrics above, reduced over processes; sample_texts and chunk_size as pass_rates takes them."""
        world, result, began = accelerator.num_processes, {}, time.time()
        for name, rows, strict, scorer in self.prior:
            mine = rows[:len(rows) // world * world][accelerator.process_index::world]
            prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in mine]
            totals = torch.zeros(4, device=accelerator.device)  # strict, lenient, format, problems
            size = chunk_size or max(1, len(prompts))
            for start in range(0, len(prompts), size):
                texts = sample_texts(prompts[start:start + size], 1, 0.0, 1.0)
                lenient, formats, _ = scorer.result(scorer.submit(texts, mine[start:start + size]))
                totals += torch.tensor([sum(a for a, t in zip(lenient, texts) if strict(t) is not None),
                                        sum(lenient), sum(formats), len(texts)], device=accelerator.device)
            totals = accelerator.reduce(totals, reduction="sum")
            n = totals[3].clamp(min=1)
            result.update({f"prior/{name}/pass@1_greedy": (totals[0] / n).item(),
                           f"prior/{name}/pass@1_lenient": (totals[1] / n).item(),
                           f"prior/{name}/format_greedy": (totals[2] / n).item()})
        if self.prior:
            result["time/eval_prior"], began = time.time() - began, time.time()
        if self.kl is not None:
            logp, counts = self._logprobs(sequence_logprobs)
            totals = accelerator.reduce(torch.stack([(self.kl["base"].to(logp.device) - logp).sum(), counts.sum(),
                                                     logp.new_tensor(len(counts))]), reduction="sum")
            result.update({"eval/forward_kl": (totals[0] / totals[2]).item(),
                           "eval/forward_kl_token": (totals[0] / totals[1].clamp(min=1)).item(),
                           "time/eval_kl": time.time() - began})
        return result

    def close(self):
        for *_, scorer in self.prior:
            scorer.close()


class Evaluation:
    """A script's held-out evaluation, which its main() calls at every step: every --eval_every steps and at the end
    (else {}), pass_rates on the training task's test rows and the Tracking's metrics, with time/eval, the seconds it
    took. The script gives its own sampling and log-probs, so the evaluation samples as its rollouts do:
    sample(prompts, n, temperature, top_p, policy_version) -> (texts, Samples, masks: per completion 1 on the policy's
    own tokens, or None[, {name: a sum over these completions}]: a script's own statistics, logged as eval/<name>_greedy
    per greedy completion of the training task: grpo_tools.py's tool calls); sequence_logprobs(prompts, samples, masks)
    -> (log pi summed over each completion, token counts); chunk_size: prompts per sample call (None: all at once).
    Made before any update: the forward KL's samples of pi_0 are drawn here (a resumed run reads them from its
    folder)."""

    def __init__(self, run, scorer, sample, sequence_logprobs, chunk_size=None):
        args, accelerator = run.args, run.accelerator
        self.run, self.scorer, self.sample, self.sequence_logprobs = run, scorer, sample, sequence_logprobs
        self.chunk_size = chunk_size
        evaluates = bool(args.run.eval_every or args.run.eval_only)
        self.tracking = Tracking(args.run.prior_tasks if evaluates else (), args.run, run.tokenizer, args.answer_format,
                                 args.instruction, args.max_prompt_length)
        if evaluates and args.run.kl_prompts and not args.run.eval_only:  # (an evaluation of pi_0 alone has KL 0)
            self.tracking.start_kl(os.path.join(run.run_dir, f"forward_kl_base.{accelerator.process_index}.pt"),
                                   run.checkpoint is not None, run.test_rows, run.tokenizer,
                                   lambda prompts: sample(prompts, 1, args.temperature, 1.0, 0)[1:3],
                                   sequence_logprobs, accelerator)

    def __call__(self, step, always=False):
        """The evaluation's metrics after `step` updates when it is due (or always), else {}."""
        flags, accelerator = self.run.args.run, self.run.accelerator
        due = flags.eval_every and (step % flags.eval_every == 0 or step == self.run.args.total_steps)
        if not (due or always):
            return {}
        start, sums = time.time(), {}

        def texts(prompts, n, temperature, top_p, own=True):  # own: the training task's (pass_rates), not a prior one
            drawn = self.sample(prompts, n, temperature, top_p, step)
            for name, value in (drawn[3] if own and temperature == 0 and len(drawn) > 3 else {}).items():
                sums[name] = sums.get(name, 0.0) + value
            return drawn[0]

        metrics = pass_rates(texts, self.scorer, self.run.tokenizer, self.run.test_rows, accelerator, flags,
                             self.chunk_size)
        for name, value in sorted(sums.items()):  # (every process has greedy completions: as many problems each)
            total = accelerator.reduce(torch.tensor(float(value), device=accelerator.device), reduction="sum")
            metrics[f"eval/{name}_greedy"] = total.item() / max(1, metrics["eval/problems"])
        metrics.update(self.tracking.evaluate(lambda *a: texts(*a, own=False), self.sequence_logprobs,
                                              self.run.tokenizer, accelerator, self.chunk_size))
        return {**metrics, "time/eval": time.time() - start}

    def close(self):
        self.tracking.close()
