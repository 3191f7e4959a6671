"""Build the embedded default model (the CartPole of LLM RL): a tiny Qwen2 causal LM and a character tokenizer,
warm-started with a few seconds of supervised learning on the toy addition task, saved to toy_model/ (this folder).

Deterministic: fixed seeds, one CPU thread. Run it again to rebuild the shipped files:
    python -m toy_model.make_toy_model      # ~20 s on one CPU core
The warm-up is deliberately short: the model samples the answer format reliably and gets some sums right, so RL has
something to improve (python grpo.py raises the reward within minutes; see README.md).

grpo_tools.py's default model, toy_model/tools/, is this model warmed up further on the toy_mul task (three-digit
times two-digit products, which it cannot compute in its head), a fraction of the examples calling the Python tool
(ToRA's convention, plumbing/tools.py) and the others guessing the product; the tool's output tokens are not trained:
    python -m toy_model.make_toy_model --tools     # ~1 min on one CPU core, after the embedded model exists

calibrated.py's default model, toy_model/calibrated/, is this model taught to state a probability after its answer
(the embedded model never writes one, and RL cannot reward a format that is never sampled): its own samples of the
train problems, 8 per problem at temperature 1, each followed by <confidence>p</confidence>, p the fraction of that
problem's 8 samples that were right (to one decimal), fitted by supervised learning. Its answers are its own samples,
so what it learns is the format and a probability of its own success per problem, not the task:
    python -m toy_model.make_toy_model --calibrated     # ~5 min on one CPU core, after the embedded model exists
"""

import json
import os
import sys
import time

import torch

from utils.rewards import extract_answer_tag
from utils.tasks import TOY_MODEL_DIR, toy_mul_problems, toy_problems
from plumbing.tools import TOOL_STOP, output_block

TOOLS_MODEL_DIR = os.path.join(TOY_MODEL_DIR, "tools")
CALIBRATED_MODEL_DIR = os.path.join(TOY_MODEL_DIR, "calibrated")

SPECIAL_TOKENS = ["<pad>", "<eos>"]


def build_tokenizer():
    """One token per byte: a byte-level BPE with no merges. Byte-level is what transformers' Qwen2Tokenizer (which
    AutoTokenizer picks for a qwen2 model folder, whatever tokenizer_config.json says) assumes, so the folder
    round-trips whichever class loads it, vLLM's included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda c: (not (c.isascii() and c.isprintable()), c))  # printable ASCII first, for readability
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def build_model(vocab_size):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def toy_completion(prompt, with_work):
    """The answer in tags, optionally after the column sums worked out ("07+45=" -> "7+5=12 0+4+1=5
    <answer>052</answer>")."""
    a, b = int(prompt[:2]), int(prompt[3:5])
    answer = f"<answer>{a + b:03d}</answer>"
    if not with_work:
        return answer
    units, carry = a % 10 + b % 10, int(a % 10 + b % 10 >= 10)
    return f"{a % 10}+{b % 10}={units} {a // 10}+{b // 10}+{carry}={a // 10 + b // 10 + carry} {answer}"


def warm_up(model, tokenizer, seconds_budget_steps=600, batch_size=64, lr=3e-3, seed=0, work_fraction=0.3,
            on_step=None):
    """Supervised warm-up on train-split problems, loss on the completion tokens only."""
    rows = toy_problems("train")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(seconds_budget_steps):
        idx = torch.randint(len(rows), (batch_size,), generator=gen).tolist()
        prompts = [tokenizer(rows[i]["prompt"])["input_ids"] for i in idx]
        with_work = torch.rand(batch_size, generator=gen) < work_fraction
        completions = [tokenizer(toy_completion(rows[i]["prompt"], w))["input_ids"] + [1]
                       for i, w in zip(idx, with_work)]
        width = max(len(p) + len(c) for p, c in zip(prompts, completions))
        ids = torch.tensor([p + c + [0] * (width - len(p) - len(c)) for p, c in zip(prompts, completions)])
        labels = ids.masked_fill(ids == 0, -100)
        labels[:, : len(prompts[0])] = -100  # all prompts have the same length
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"warm-up step {step} loss {loss.item():.3f}")
        if on_step is not None:
            on_step(step)
    model.eval()


def tool_demo(prompt, call):
    """toy_mul's demonstrations as (text, trained) pieces: one tool call, then the answer copied from its output; or
    the answer guessed directly. The tool's output is the environment's: not trained."""
    a, b = prompt[:-1].split("*")
    answer = f"<answer>{int(a) * int(b)}</answer>"
    if not call:
        return [(answer, True)]
    return [(f"```python\nprint({a}*{b}){TOOL_STOP}", True), (output_block(f"{int(a) * int(b)}\n", "", 512), False),
            (answer, True)]


def warm_up_tools(model, tokenizer, steps, batch_size=64, lr=3e-3, seed=0, call_fraction=0.3):
    """Supervised warm-up on toy_mul train problems: loss on the model's pieces only (tool output and prompt masked)."""
    rows = toy_mul_problems("train")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        idx = torch.randint(len(rows), (batch_size,), generator=gen).tolist()
        calls = (torch.rand(batch_size, generator=gen) < call_fraction).tolist()
        ids, labels = [], []
        for i, call in zip(idx, calls):
            seq = tokenizer(rows[i]["prompt"])["input_ids"]
            lab = [-100] * len(seq)
            for text, trained in tool_demo(rows[i]["prompt"], call):
                piece = tokenizer(text)["input_ids"]
                seq, lab = seq + piece, lab + (piece if trained else [-100] * len(piece))
            ids.append(seq + [1])
            lab.append(1)
            labels.append(lab)
        width = max(map(len, ids))
        input_ids = torch.tensor([s + [0] * (width - len(s)) for s in ids])
        label_ids = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
        loss = model(input_ids=input_ids, labels=label_ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"tool warm-up step {step} loss {loss.item():.3f}")
    model.eval()


@torch.no_grad()
def confidence_demos(model, tokenizer, rows, samples=8, batch_size=128, seed=0):
    """The model's own completions of `rows`, `samples` each (temperature 1, at most 48 tokens; those cut there
    dropped), each followed by <confidence>p</confidence>, p the fraction of its problem's samples that are right,
    to one decimal: a list of (prompt ids, completion ids ending with <eos>)."""
    torch.manual_seed(seed)
    demos = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]  # every toy prompt has 6 characters: no padding
        prompts = torch.tensor([tokenizer(r["prompt"])["input_ids"] for r in chunk])
        out = model.generate(prompts, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=48,
                             num_return_sequences=samples, pad_token_id=0, eos_token_id=1)[:, prompts.shape[1]:]
        for k, row in enumerate(chunk):
            ids = out[k * samples:(k + 1) * samples].tolist()
            texts = [tokenizer.decode(c, skip_special_tokens=True) for c in ids]
            p = sum(extract_answer_tag(t) == row["answer"] for t in texts) / samples
            demos += [(prompts[k].tolist(), tokenizer(f"{t}<confidence>{p:.1f}</confidence>")["input_ids"] + [1])
                      for t, c in zip(texts, ids) if 1 in c]
    return demos


def warm_up_confidence(model, demos, steps, batch_size=64, lr=1e-3, seed=0):
    """Supervised learning on the demonstrations (prompt, completion): loss on the completions' tokens."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        picked = [demos[i] for i in torch.randint(len(demos), (batch_size,), generator=gen).tolist()]
        width = max(len(p) + len(c) for p, c in picked)
        ids = torch.tensor([p + c + [0] * (width - len(p) - len(c)) for p, c in picked])
        labels = torch.tensor([[-100] * len(p) + c + [-100] * (width - len(p) - len(c)) for p, c in picked])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"confidence warm-up step {step} loss {loss.item():.3f}")
    model.eval()


def save(model, tokenizer, out_dir):
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # Save as a plain fast tokenizer: recent transformers would reload a Qwen2-typed folder as Qwen2Tokenizer.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def main_tools(out_dir=TOOLS_MODEL_DIR, steps=1200, base=TOY_MODEL_DIR):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    start = time.time()
    # mostly calls first (copying operands and output takes practice), then few: the rate RL starts from is low
    warm_up_tools(model, tokenizer, steps=steps, call_fraction=0.7)
    warm_up_tools(model, tokenizer, steps=steps // 8, lr=1e-3, seed=1, call_fraction=0.2)
    print(f"tool warm-up took {time.time() - start:.1f} s")
    save(model, tokenizer, out_dir)


def main_calibrated(out_dir=CALIBRATED_MODEL_DIR, steps=800, base=TOY_MODEL_DIR, problems=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    start = time.time()
    demos = confidence_demos(model, tokenizer, toy_problems("train")[:problems])  # (None: all 9,500)
    print(f"{len(demos)} demonstrations sampled in {time.time() - start:.1f} s")
    warm_up_confidence(model, demos, steps=steps)
    print(f"confidence warm-up took {time.time() - start:.1f} s")
    save(model, tokenizer, out_dir)


def main(out_dir=TOY_MODEL_DIR, steps=400):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    start = time.time()
    warm_up(model, tokenizer, seconds_budget_steps=steps)
    print(f"warm-up took {time.time() - start:.1f} s; {sum(p.numel() for p in model.parameters())} parameters")
    save(model, tokenizer, out_dir)


if __name__ == "__main__":
    main_tools() if "--tools" in sys.argv[1:] else main_calibrated() if "--calibrated" in sys.argv[1:] else main()
