"""Where in each weight matrix training moved the weights (The Path Not Taken, arXiv 2511.08567: RLVR's updates avoid
the principal directions of the pretrained weights, leave their spectrum and top singular subspace nearly as they
were, while SFT's target them; the apparent sparsity of RL updates is bf16 rounding).

    python benchmarks/update_spectrum.py --base smollm2-135m \\
        --runs grpo=runs/benchmarks/forgetting_smollm2/grpo_lr1e-5__1/final \\
               sft=runs/benchmarks/forgetting_smollm2/sft_lr1e-5__1/final

For every 2-D weight of the decoder layers (W, the base's; W' = W + dW, the run's final/ folder, or any model folder),
with W = U S V^T and U_k, V_k its top-k singular vectors (--top_k):
- principal overlap: ||U_k^T dW V_k||_F^2 / ||dW||_F^2, the share of the update's energy in the principal block; an
  update of random direction has (k/m)(k/n) there in expectation (the `random` column), so overlap / random says how
  much the update seeks (> 1) or avoids (< 1) the principal directions;
- rotation: the largest principal angle, in degrees, between the top-k left singular subspaces of W and W';
- spectral drift: the mean over the top k of |s_i(W') - s_i(W)| / s_i(W);
- bf16 changed, float32 changed: the fraction of entries whose bf16 (float32) value differs between W and W' (the
  paper's point: a float32 update smaller than half a bf16 ulp looks like no update at all in a bf16 checkpoint);
- relative update: ||dW||_F / ||W||_F.
Writes benchmarks/results/<name>.md (per run: the means over matrices, and per kind of matrix) and .png (per layer).
"""

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.models import resolve_model  # noqa: E402
from toy_runs import pyplot, write_results  # noqa: E402

COLUMNS = ["overlap", "random", "overlap / random", "rotation (deg)", "spectral drift", "bf16 changed",
           "float32 changed", "relative update"]


def weights(model):
    """{name: float32 tensor} of the model's 2-D weights inside its decoder layers (embeddings and head left out)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32)
    return {name: p.detach() for name, p in loaded.named_parameters() if p.dim() == 2 and ".layers." in name}


def layer_and_kind(name):
    """model.layers.12.self_attn.q_proj.weight -> (12, self_attn.q_proj)."""
    rest = name.split(".layers.", 1)[1].removesuffix(".weight")
    layer, _, kind = rest.partition(".")
    return int(layer), kind


def measures(base, tuned, k, base_svd):
    """The measures above for one matrix, in float64; base_svd: (U, S, V^T) of the base matrix."""
    w, w2 = base.double(), tuned.double()
    dw = w2 - w
    m, n = w.shape
    k = min(k, m, n)
    u, s, vh = base_svd
    u2, s2, _ = torch.linalg.svd(w2, full_matrices=False)
    energy = dw.pow(2).sum()
    overlap = ((u[:, :k].T @ dw @ vh[:k].T).pow(2).sum() / energy).item() if energy > 0 else float("nan")
    cosines = torch.linalg.svdvals(u[:, :k].T @ u2[:, :k]).clamp(max=1.0)
    random = k * k / (m * n)
    return {"overlap": overlap, "random": random, "overlap / random": overlap / random,
            "rotation (deg)": torch.rad2deg(torch.arccos(cosines.min())).item(),
            "spectral drift": ((s2[:k] - s[:k]).abs() / s[:k]).mean().item(),
            "bf16 changed": (base.bfloat16() != tuned.bfloat16()).double().mean().item(),
            "float32 changed": (base != tuned).double().mean().item(),
            "relative update": (energy.sqrt() / w.pow(2).sum().sqrt()).item()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="smollm2-135m", help="the model the runs started from")
    parser.add_argument("--runs", nargs="+", required=True, help="LABEL=MODEL_FOLDER (a run's final/)")
    parser.add_argument("--top_k", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="update_spectrum_smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    for item in args.runs:
        label, eq, folder = item.partition("=")
        if not eq or not os.path.isdir(folder):
            raise SystemExit(f"error: --runs {item}: give LABEL=FOLDER, a model folder (a run's final/)")
        runs.append((label, folder))
    base = weights(args.base)
    base_svd = {name: torch.linalg.svd(w.double(), full_matrices=False) for name, w in base.items()}  # once for all
    table, per_layer = {}, {}
    for label, folder in runs:
        tuned = weights(folder)
        if tuned.keys() != base.keys():
            raise SystemExit(f"error: {folder} is not a model of --base {args.base}'s shape")
        rows = {name: measures(base[name], tuned[name], args.top_k, base_svd[name]) for name in base}
        table[label] = rows
        per_layer[label] = {}
        for name, row in rows.items():
            per_layer[label].setdefault(layer_and_kind(name)[0], []).append(row)
    lines = [f"# {args.name}", "", "`python benchmarks/update_spectrum.py " + " ".join(sys.argv[1:]) + "`", "",
             f"Every 2-D weight of the decoder layers against --base {args.base}, top k = {args.top_k}; means over "
             "matrices (benchmarks/update_spectrum.py's docstring defines each column).", "",
             "| run | matrices | " + " | ".join(COLUMNS) + " |", "|---" * (2 + len(COLUMNS)) + "|"]
    for label, rows in table.items():
        lines.append(f"| {label} | {len(rows)} | " + " | ".join(
            f"{np.nanmean([r[c] for r in rows.values()]):.4g}" for c in COLUMNS) + " |")
    lines += ["", "By kind of matrix:", "", "| run | kind | " + " | ".join(COLUMNS) + " |",
              "|---" * (2 + len(COLUMNS)) + "|"]
    for label, rows in table.items():
        kinds = sorted({layer_and_kind(name)[1] for name in rows})
        for kind in kinds:
            chosen = [r for name, r in rows.items() if layer_and_kind(name)[1] == kind]
            lines.append(f"| {label} | {kind} | " + " | ".join(
                f"{np.nanmean([r[c] for r in chosen]):.4g}" for c in COLUMNS) + " |")
    path = write_results(args.name, lines)
    plt = pyplot()
    if plt is not None:
        shown = ["overlap / random", "rotation (deg)", "spectral drift", "bf16 changed"]
        fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.6))
        for ax, column in zip(axes, shown):
            for label, layers in per_layer.items():
                xs = sorted(layers)
                ax.plot(xs, [np.nanmean([r[column] for r in layers[x]]) for x in xs], marker=".", label=label)
            ax.set(xlabel="layer", title=column)
        axes[0].axhline(1.0, color="gray", linestyle=":")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(path + ".png", dpi=110)


if __name__ == "__main__":
    main()
