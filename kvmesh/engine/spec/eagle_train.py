"""`kvmesh train-eagle`: self-distil an EAGLE head for a target model on CPU.

1. Data: the target answers the training prompts (chat and JSON / tool-call requests), greedy and
   sampled; each conversation is then run through the target once more, teacher-forced, to keep
   the captured layers' outputs and the target's own next-token choice at every position.
2. Draft vocabulary: the `draft_vocab` tokens the target chooses most often.
3. Training with "training-time test" (EAGLE-3): step 0 reads the target's features; step j
   reads the head's own step j-1 output one position back and attends to step-0 keys up to
   position t - j plus its own earlier steps' keys on the diagonal -- what drafting sees.
   Loss: cross-entropy against the target's choice (positions whose choice is outside the draft
   vocabulary are skipped), weighted 0.8**j.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.spec.eagle import EagleConfig, EagleHead, window_mask
from kvmesh.engine.spec.prompts import chat_prompts, split, structured_prompts

log = structlog.get_logger(__name__)
HELD_OUT = 24  # prompts kept out of training (the benchmark's)


@dataclass(frozen=True)
class TrainOptions:
    model: str = "smollm2-135m"
    output: Path = Path("eagle.safetensors")
    max_tokens: int = 112
    samples_per_prompt: int = 2  # greedy + (n - 1) sampled answers
    draft_vocab: int = 4096
    window: int = 32
    steps_ttt: int = 3
    epochs: int = 6
    batch_tokens: int = 2048
    seq_len: int = 256
    lr: float = 2e-3
    seed: int = 0
    limit_prompts: int = 0  # 0: all training prompts (smaller for smoke tests)


@dataclass
class Dataset:
    features: list[torch.Tensor]  # per conversation [T, F] (float32)
    tokens: list[torch.Tensor]  # [T] token ids
    choice: list[torch.Tensor]  # [T] the target's argmax after each position

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def build_dataset(options: TrainOptions, prompts: list[str]) -> Dataset:
    from kvmesh import LLM

    gen = LLM(model=options.model, dtype="bf16", max_num_seqs=32, kv_cache_bytes=256 << 20)
    convs = [gen.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    runs = []
    for i in range(options.samples_per_prompt):
        params = SamplingParams(
            max_tokens=options.max_tokens,
            temperature=0.0 if i == 0 else 0.8,
            top_p=0.95,
            seed=options.seed + i,
        )
        runs += [
            c + o.token_ids for c, o in zip(convs, gen.generate_ids(convs, params), strict=True)
        ]
    del gen
    target = LLM(model=options.model, dtype="fp32", kv_cache_bytes=64 << 20)
    config = EagleConfig.for_target(
        target.engine.source.name, target.engine.model_config, options.draft_vocab, options.window
    )
    data = Dataset([], [], [])
    with target.engine.runner.using(capture=config.capture_layers):
        for ids in runs:
            logits = target.engine.score(ids)
            data.features.append(target.engine.runner.features.clone())
            data.tokens.append(torch.tensor(ids))
            data.choice.append(logits.argmax(dim=-1))
    return data


def draft_vocabulary(data: Dataset, size: int) -> torch.Tensor:
    counts = torch.bincount(torch.cat(data.choice))
    size = min(size, int((counts > 0).sum()))
    return counts.topk(size).indices.sort().values


def _windows(data: Dataset, seq_len: int) -> list[tuple[int, int, int]]:
    """(conversation, start, end) slices of at most seq_len + 1 tokens."""
    out = []
    for c, tokens in enumerate(data.tokens):
        for start in range(0, max(len(tokens) - 2, 1), seq_len):
            out.append((c, start, min(start + seq_len + 1, len(tokens))))
    return out


def _batch(data: Dataset, slices, t2d: torch.Tensor, embed: torch.Tensor):
    """Padded tensors: features [B, L, F], next-token embeddings [B, L, H], labels [B, L]."""
    length = max(end - start - 1 for _, start, end in slices)
    feats, embeds, labels = [], [], []
    for c, start, end in slices:
        n = end - start - 1
        pad = length - n
        feats.append(F.pad(data.features[c][start : start + n], (0, 0, 0, pad)))
        embeds.append(F.pad(embed[data.tokens[c][start + 1 : end]], (0, 0, 0, pad)))
        # position t predicts the target's choice after token t+1
        label = t2d[data.choice[c][start + 1 : end]]
        labels.append(F.pad(label, (0, pad), value=-100))
    return torch.stack(feats), torch.stack(embeds), torch.stack(labels)


def ttt_loss(head: EagleHead, feats, embeds, labels, steps: int) -> tuple[torch.Tensor, list]:
    batch, length = labels.shape
    positions = torch.arange(length)
    hidden = head.fc(feats)
    q, k0, v0 = head.project(embeds, hidden, positions)
    keys, values = [k0], [v0]
    total, accuracy, out = torch.zeros(()), [], hidden
    for step in range(steps):
        if step:
            hidden = F.pad(out[:, :-1], (0, 0, 1, 0))  # the previous step's output, one back
            q, k, v = head.project(embeds, hidden, positions)
            keys.append(k)
            values.append(v)
        out = head.finish(hidden, _ttt_attend(head, q, keys, values, step))
        logits = head.logits(out)
        target = labels.clone()
        target[:, :step] = -100  # no previous-step output there yet
        total = total + 0.8**step * F.cross_entropy(
            logits.flatten(0, 1), target.flatten(), ignore_index=-100
        )
        valid = target >= 0
        accuracy.append(float((logits.argmax(-1) == target)[valid].float().mean()))
    return total, accuracy


def _ttt_attend(head: EagleHead, q, keys, values, step: int) -> torch.Tensor:
    """Query t at step j: step-0 keys at s <= t - j (window), step-i keys at t - j + i."""
    length = q.shape[1]
    pos = torch.arange(length)
    mask = window_mask(pos - step, pos, head.config.window - step)  # [L, L]
    groups = head.config.num_heads // head.config.num_kv_heads
    expand = lambda x: x.repeat_interleave(groups, dim=-2)  # noqa: E731
    scale = head.config.head_dim**-0.5
    scores = [torch.einsum("bqhd,bkhd->bhqk", q, expand(keys[0])) * scale]
    scores[0] = scores[0].masked_fill(~mask, float("-inf"))
    diag = []
    for i in range(1, step + 1):
        k_i = F.pad(expand(keys[i]), (0, 0, 0, 0, step - i, 0))[:, :length]  # k_i[t - (j - i)]
        v_i = F.pad(expand(values[i]), (0, 0, 0, 0, step - i, 0))[:, :length]
        scores.append((q * k_i).sum(-1).transpose(1, 2).unsqueeze(-1) * scale)  # [B, H, L, 1]
        diag.append(v_i)
    probs = torch.cat(scores, dim=-1).softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :length], expand(values[0]))
    for i, v_i in enumerate(diag):
        out = out + probs[..., length + i].transpose(1, 2).unsqueeze(-1) * v_i
    return out


def train(options: TrainOptions) -> dict:
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    prompts, _ = split(chat_prompts() + structured_prompts(), HELD_OUT, options.seed)
    prompts = prompts[: options.limit_prompts or None]
    data = build_dataset(options, prompts)
    data_s = time.perf_counter() - started
    from kvmesh.engine.loader import load_weights, resolve_model

    source = resolve_model(options.model)
    model_config, weights = load_weights(source)
    embed = weights["model.embed_tokens.weight"].float()
    config = EagleConfig.for_target(source.name, model_config, options.draft_vocab, options.window)
    vocab = draft_vocabulary(data, options.draft_vocab)
    config = EagleConfig(**{**config.__dict__, "draft_vocab_size": len(vocab)})
    head = EagleHead(config)
    head.d2t.copy_(vocab)
    t2d = torch.full((model_config.vocab_size,), -100, dtype=torch.long)
    t2d[vocab] = torch.arange(len(vocab))
    slices = _windows(data, options.seq_len)
    per_batch = max(1, options.batch_tokens // options.seq_len)
    steps = options.epochs * -(-len(slices) // per_batch)
    optim = torch.optim.AdamW(head.parameters(), lr=options.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        optim, options.lr, total_steps=steps, pct_start=0.05
    )
    rng = random.Random(options.seed)
    accuracy: list[float] = []
    for epoch in range(options.epochs):
        rng.shuffle(slices)
        for b in range(0, len(slices), per_batch):
            feats, embeds, labels = _batch(data, slices[b : b + per_batch], t2d, embed)
            loss, accuracy = ttt_loss(head, feats, embeds, labels, options.steps_ttt)
            optim.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optim.step()
            sched.step()
        log.info("eagle.epoch", epoch=epoch, loss=float(loss.detach()), accuracy=accuracy)
    head.eval()
    options.output.parent.mkdir(parents=True, exist_ok=True)
    head.save(options.output)
    return {
        "prompts": len(prompts),
        "conversations": len(data.tokens),
        "tokens": data.num_tokens,
        "draft_vocab": len(vocab),
        "data_s": round(data_s, 1),
        "total_s": round(time.perf_counter() - started, 1),
        "last_accuracy": accuracy,
        "bytes": options.output.stat().st_size,
        "output": str(options.output),
    }
