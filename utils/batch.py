"""The rollout batch: B rows of [left-padded prompt | right-padded completion] and the per-token tensors that go with
them, and its micro-batches for the trainer's passes."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Batch:
    """B completions with P = prompt_width prompt positions and T completion positions. A script that needs more
    per-completion tensors subclasses it (ppo.py: the critic's values and returns); every tensor field is sliced by
    rows, and the (B, T) ones are cut with the completions."""
    input_ids: torch.Tensor  # (B, P + T) token ids, pad outside the attention mask
    attention_mask: torch.Tensor  # (B, P + T) 1 on real tokens
    prompt_width: int  # P
    mask: torch.Tensor  # (B, T) float, 1 on the completion's tokens (the ones trained on)
    engine_logp: torch.Tensor  # (B, T) the engine's log-prob of each sampled token (0 where greedy)
    advantages: Optional[torch.Tensor] = None  # (B, T) per token (GRPO: the completion's advantage on each token)
    old_logp: Optional[torch.Tensor] = None  # (B, T) pi_old, when the trainer computed it before the update
    ref_logp: Optional[torch.Tensor] = None  # (B, T) pi_ref, when there is a KL term

    def __len__(self):
        return len(self.mask)

    def select(self, rows, width=None):
        """The rows `rows` (an index tensor), with completions cut to their first `width` positions."""
        width = self.mask.shape[1] if width is None else width
        cut = {"input_ids": self.prompt_width + width, "attention_mask": self.prompt_width + width}
        return dataclasses.replace(self, **{f.name: value[rows][:, :cut.get(f.name, width)] if value.dim() == 2 else
                                            value[rows] for f in dataclasses.fields(self)
                                            if torch.is_tensor(value := getattr(self, f.name))})


def make_batch(prompts, samples, pad_id, device):
    """Prompt token-id lists and the engine's Samples (one prompt per sample) -> a Batch."""
    prompt_width = max(len(p) for p in prompts)
    width = max(len(sample.token_ids) for sample in samples)
    ids, attention, mask, engine_logp = [], [], [], []
    for prompt, sample in zip(prompts, samples):
        left, right = prompt_width - len(prompt), width - len(sample.token_ids)
        ids.append([pad_id] * left + prompt + sample.token_ids + [pad_id] * right)
        attention.append([0] * left + [1] * (len(prompt) + len(sample.token_ids)) + [0] * right)
        mask.append([1] * len(sample.token_ids) + [0] * right)
        engine_logp.append((sample.logprobs or [0.0] * len(sample.token_ids)) + [0.0] * right)
    return Batch(torch.tensor(ids, device=device), torch.tensor(attention, device=device), prompt_width,
                 torch.tensor(mask, dtype=torch.float32, device=device),
                 torch.tensor(engine_logp, dtype=torch.float32, device=device))


def micro_batches(batch, size):
    """Yield (rows, micro-batch): `batch` cut into micro-batches of `size` rows of similar completion lengths, each
    cut to its own longest completion, so that no pass pads a 10-token completion to the batch's 48 (about half of
    the trainer's compute on the toy). Which rows share a micro-batch does not change the summed gradient. A
    completion's length is its last trained token's position + 1 (grpo_tools.py masks tool output in between)."""
    positions = torch.arange(1, batch.mask.shape[1] + 1, device=batch.mask.device, dtype=batch.mask.dtype)
    lengths, order = torch.sort((batch.mask * positions).amax(-1), stable=True)
    widths = lengths[size - 1::size].tolist() + lengths[-1:].tolist()  # one host sync
    for rows, width in zip(order.split(size), widths):
        yield rows, batch.select(rows, max(1, int(width)))  # >= 1: dapo.py's filtering can mask whole rows
