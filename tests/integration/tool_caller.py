"""A tiny long-context model that real agent CLIs (Claude Code, Codex CLI, OpenCode) drive
through one shell tool call. `python -m tests.integration.tool_caller DIR` trains it (2 minutes on
2 CPU cores); tests/data/tool-caller is its output, committed: the suite does not train it.

In kvmesh's hermes tool prompt (agent/templates.py), PROMPTS[client] makes it call that client's
shell tool with COMMAND, and a `<tool_response>` makes it answer OUTPUT. It is kvmesh's tiny
llama (hidden 128, 131072 positions) after 300 AdamW steps (loss on the answers) on synthetic
1-3k-token requests, made to hold in the CLIs' 20-50k-token ones: RoPE in two bands (llama3
scaling: 11 fast pairs, wavelengths <= 300 tokens, for local order; 5 slowed 1e5 times, position-
free, for lookups at any distance); layer 0 starts wired to find the prompt's key word (Liberty,
Nature, Happiness: in no agent's prompt); system messages' tokens count up to 200 times as
attention keys and the first one sits up to 60k positions back. lm_head is scaled 6x on save:
sampling at temperature 1, as the CLIs do, then gives the greedy answer.

Training is seed-sensitive. On the first and second requests (before and after the tool's
output) of the three CLIs, captured by hand and not kept (they are the vendors' prompts), seeds
0, 1 and 3 missed Claude Code's or Codex's call and seed 2 Codex's final answer (it copied the
call's `'` after `kvmesh-ok`); seed 4, the default, got every answer token with a logit margin
of 22 or more (p > 0.999999). test_agent_clis.py is the check of a retrained model.
"""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import DynamicCache

from kvmesh.agent.conversation import Conversation, Message, Tool, ToolCall
from kvmesh.agent.templates import builtin_messages
from kvmesh_apps.tools.tiny_configs import TinySize, TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model, randomize

OUTPUT = "kvmesh-ok"  # what COMMAND prints: the final answer
COMMAND = f"echo {OUTPUT}"
KEYS = {"claude": "Liberty", "codex": "Nature", "opencode": "Happiness"}
PROMPT = "Run {} with your shell tool for the {} check, then reply with its output."
PROMPTS = {client: PROMPT.format(COMMAND, key) for client, key in KEYS.items()}
CODEX_JS = f"text(await tools.exec_command({{cmd: '{COMMAND}'}}))"  # Codex's `exec` runs JS
CALLS = {
    "claude": ("Bash", {"command": COMMAND}),
    "opencode": ("bash", {"command": COMMAND}),
    "codex": ("functions.exec", {"input": CODEX_JS}),
}
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500.0,
    "factor": 1e5,
    "low_freq_factor": 8192 / 400,
    "high_freq_factor": 8192 / 350,
    "original_max_position_embeddings": 8192,
}
SHELL = {
    "type": "object",
    "required": ["command"],
    "properties": {
        "command": {"type": "string", "description": "The command to execute"},
        "timeout": {"type": "number"},
        "description": {"type": "string"},
    },
}
CUSTOM = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
LARK = "\nIts input is text in this lark grammar:\nstart: plain_source\nSOURCE: /[\\s\\S]+/"
DOCS = ("README.md", "docs/architecture.md")  # as of DOCS_AT: the prose, fixed
DOCS_AT = "e5e96d7"
FILL, IM_END = "@@FILL@@", "<|im_end|>"  # FILL: where filler tokens go


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 4  # see the docstring
    steps: int = 300
    batch: int = 4
    lr: float = 3e-3
    ramp: float = 0.6  # share of the steps over which requests grow to full size
    max_repeat: float = 200.0  # system messages' tokens count up to this often as keys
    max_gap: int = 60_000  # positions between the first system message and the rest
    filler: int = 300  # filler tokens at most
    first_weight: float = 10.0  # loss weight of an answer's first token (call or final answer)
    sharpen: float = 6.0  # lm_head scale on save


def build_tool_caller(output: Path, config: TrainConfig = TrainConfig()) -> Path:
    """Write the trained checkpoint (config, safetensors, tokenizer) to `output`; return it."""
    size = TinySize(hidden_size=128, intermediate_size=256, num_heads=4)
    make_tiny_model(TinySpec("llama", config.seed, size, max_position_embeddings=131072), output)
    hf_config = json.loads((output / "config.json").read_text()) | {"rope_parameters": ROPE}
    (output / "config.json").write_text(json.dumps(hf_config, indent=2))
    model, tokenizer = _model(output, config.seed)
    _train(model, tokenizer, config)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] *= config.sharpen
    save_file(state, str(output / "model.safetensors"), metadata={"format": "pt"})
    return output


def _docs() -> list[str]:
    root = Path(__file__).resolve().parents[2]
    show = ["git", "-C", str(root), "show"]
    return [
        subprocess.run([*show, f"{DOCS_AT}:{p}"], check=True, capture_output=True, text=True).stdout
        for p in DOCS
    ]


def _model(output: Path, seed: int) -> tuple:
    transformers.AttentionInterface.register("repeated", _repeated_attention)
    config = transformers.AutoConfig.from_pretrained(str(output))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="repeated")
    randomize(model, seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(output))
    _wire_lookup(model, tokenizer, seed)
    return model.train(), tokenizer


@torch.no_grad()
def _wire_lookup(model, tokenizer, seed: int) -> None:
    """Every embedding gains a direction u, the key words also w; layer 0's first query head
    reads u and its key head w in the position-free dims: key words score ~20, others ~0."""
    hidden, half = model.config.hidden_size, model.config.head_dim // 2
    g = torch.Generator().manual_seed(seed)
    u, w = torch.linalg.qr(torch.randn(hidden, 2, generator=g))[0].T
    embed = model.model.embed_tokens.weight
    embed += 2.0 * u
    embed[tokenizer.convert_tokens_to_ids([f"Ġ{key}" for key in KEYS.values()])] += 2.0 * w
    attention, slow = model.model.layers[0].self_attn, model.model.rotary_emb.inv_freq < 1e-4
    for d in [d for i in range(half) if slow[i] for d in (i, i + half)]:
        attention.q_proj.weight[d], attention.k_proj.weight[d] = 0.45 * u, 0.45 * w


def _repeated_attention(module, query, key, value, attention_mask, scaling, boost, **kwargs):
    """Causal attention adding boost[b, j] (ln of key j's repeat count) to key j's logits, as
    one more q/k dim (q: 1/scaling, k: boost); the queries are the last query.shape[2] keys."""
    key = key.repeat_interleave(module.num_key_value_groups, 1)
    value = value.repeat_interleave(module.num_key_value_groups, 1)
    n_q, n_k = query.shape[2], key.shape[2]
    extra = boost[:, None, :n_k, None].expand(-1, key.shape[1], -1, -1).to(key.dtype)
    query = torch.cat([query, torch.full_like(query[..., :1], 1 / scaling)], -1)
    key, value = torch.cat([key, extra], -1), torch.cat([value, torch.zeros_like(extra)], -1)
    past = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
    causal = {"is_causal": True} if n_q == n_k else {"attn_mask": past}
    out = F.scaled_dot_product_attention(query, key, value, scale=scaling, **causal)
    return out[..., :-1].transpose(1, 2).contiguous(), None


class Requests:
    """Seeded synthetic agent requests whose size grows with `scale` in [0, 1]: kvmesh's docs
    as prose, random tools and the client's shell tool (others' at times), one of the CLIs'
    prompt layouts, then the call, its result and the final answer."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        paragraphs = re.split(r"\n\s*\n", "\n\n".join(_docs()))
        keys = re.compile("|".join(KEYS.values()))  # in the prompts only
        self.texts = [p.strip() for p in paragraphs if p.strip() and not keys.search(p)]
        self.words = sorted({w for p in self.texts for w in re.findall(r"[A-Za-z]{3,}", p)})

    def upto(self, n: float) -> int:
        return self.rng.randint(0, int(n))

    def prose(self, chars: int, bullets: bool = False) -> str:
        """Paragraphs, or a list of named items like Claude Code's agents and skills."""
        out: list[str] = []
        while sum(len(p) + 2 for p in out) < chars:
            text = self.rng.choice(self.texts)
            out.append(f"- {self.name()}: {text[:300]}" if bullets else text)
        return "\n\n".join(out)[:chars]

    def name(self) -> str:
        words = [self.rng.choice(self.words) for _ in range(self.rng.randint(1, 3))]
        style = self.rng.random()
        return "".join(w.capitalize() for w in words) if style < 0.4 else "_".join(words).lower()

    def tool(self, name: str, size: float) -> Tool:
        kinds = ("string", "number", "boolean", "integer")
        props = {self.name().lower(): {"type": self.rng.choice(kinds)} for _ in range(self.upto(4))}
        for prop in props.values():
            prop["description"] = self.prose(self.upto(size / 4))
        schema = {"type": "object", "properties": props, "required": sorted(props)[:1]}
        return Tool(name, self.prose(self.upto(size)), schema)

    def filler(self, tools: int = 150) -> str:
        """Text that pads requests: tools as the built-in template lists them, and prose."""
        parts = [json.dumps(self.tool(self.name(), 800).openai_shape()) for _ in range(tools)]
        parts += self.texts  # kvmesh's docs
        self.rng.shuffle(parts)
        return "\n".join(parts)

    def tools(self, client: str, scale: float) -> tuple[Tool, ...]:
        names = {self.name() for _ in range(self.upto(3 * scale))} - {"bash", "functions.exec"}
        tools = [self.tool(name, 200 * scale) for name in sorted(names)]
        for other in CALLS:
            if other == client or self.rng.random() < 0.3:
                text = self.prose(self.upto(30 + 300 * scale))
                shell = (text + LARK, CUSTOM) if other == "codex" else (text, SHELL)
                tools.insert(self.rng.randint(0, len(tools)), Tool(CALLS[other][0], *shell))
        return tuple(tools)

    def prompt(self, client: str, scale: float) -> list[Message]:
        prompt, layout = PROMPTS[client], self.rng.choice(["claude", "codex", "opencode", "plain"])
        if layout == "claude":
            reminder = self.prose(self.upto(20 + 200 * scale))
            return [
                Message("user", f"<system-reminder>\n{reminder}\n</system-reminder>\n\n{prompt}")
            ]
        if layout == "codex":
            cwd = f"<environment_context>\n  <cwd>/tmp/{self.name()}</cwd>\n</environment_context>"
            return [Message("user", cwd), Message("user", prompt)]
        return [Message("user", f'"{prompt}"' if layout == "opencode" else prompt)]

    def result(self) -> str:
        codex = json.dumps({"exit_code": 0, "wall_time": "0.1s", "output": OUTPUT + "\n"})
        codex = f"Script completed\nWall time 0.1 seconds\nOutput:\n\n{codex}"
        return self.rng.choice([OUTPUT, OUTPUT + "\n", codex, self.prose(self.rng.randint(1, 200))])

    def request(self, scale: float) -> Conversation:
        """A request ending in the model's two answers: the call and, after its result, OUTPUT."""
        client, system = self.rng.choice(sorted(CALLS)), Message("system", FILL)
        call = ToolCall("call_1", CALLS[client][0], json.dumps(CALLS[client][1]))
        result = Message("tool", self.result(), tool_call_id="call_1")
        answers = [Message("assistant", "", (call,)), result, Message("assistant", OUTPUT)]
        if self.rng.random() < 0.08:  # OpenCode's title request: no tools
            title = Message("user", "Generate a title for this conversation:\n")
            return Conversation((system, title, Message("user", f'"{PROMPTS[client]}"'), *answers))
        turn = self.prompt(client, scale)
        if self.rng.random() < 0.5:  # Claude Code's system message after the prompt
            text = self.prose(self.upto(2500 * scale), bullets=self.rng.random() < 0.5)
            turn.append(Message("system", text))
        if self.rng.random() < 0.25:  # an earlier exchange: the answers follow the last turn
            turn = [*self.prompt(client, scale), *answers, *turn]
        tools, parallel = self.tools(client, scale), self.rng.random() < 0.5
        return Conversation((system, *turn, *answers), tools, parallel_tool_calls=parallel)


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, T]
    weights: torch.Tensor  # [B, T]: loss weight of predicting ids[:, t] (0 outside answers)
    boost: torch.Tensor  # [B, T]: ln of each token's repeat count as an attention key
    positions: torch.Tensor  # [B, T]


def _render(request: Conversation) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """ChatML text as kvmesh renders it; char spans of the last two answers (each with its
    <|im_end|>) and of the system messages' contents."""
    text, answers, systems = "", [], []
    for message in builtin_messages(request):
        text += f"<|im_start|>{message['role']}\n"
        start = len(text)
        text += message["content"]
        if message["role"] == "system" and not systems:
            systems.append((start, len(text)))
        text += IM_END
        if message["role"] == "assistant":
            answers = [*answers[-1:], (start, len(text))]
        text += "\n"
    return text, answers, systems


def _example(tokenizer, requests: Requests, scale: float) -> tuple[list, list, list, int]:
    """One request's ids, answer and system-message masks (FILL dropped), and FILL's index."""
    text, answers, systems = _render(requests.request(scale))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    at, tokens = text.index(FILL), zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
    kept = [(t, s, e) for t, (s, e) in tokens if e <= at or s >= at + len(FILL)]

    def inside(spans: list[tuple[int, int]]) -> list[bool]:
        return [any(a <= s and e <= b for a, b in spans) for _, s, e in kept]

    return [t for t, _, _ in kept], inside(answers), inside(systems), sum(e <= at for *_, e in kept)


def _batch(tokenizer, requests: Requests, filler: list, config: TrainConfig, scale: float) -> Batch:
    """Requests padded to one length with filler tokens where FILL was; per request a repeat
    count for its system messages and a gap after its first one."""
    examples = [_example(tokenizer, requests, scale) for _ in range(config.batch)]
    length = max(len(e[0]) for e in examples) + requests.upto(config.filler * scale)
    rows, rng = [], requests.rng
    for ids, answer, system, at in examples:
        n, start = length - len(ids), rng.randrange(len(filler) - length)
        ids = ids[:at] + filler[start : start + n] + ids[at:]
        answer = answer[:at] + [False] * n + answer[at:]
        first = [a and not answer[i - 1] for i, a in enumerate(answer)]  # a call's or OUTPUT's
        weights = [
            config.first_weight if f else float(a) for a, f in zip(answer, first, strict=True)
        ]
        repeat = rng.uniform(0, math.log(config.max_repeat) * scale)
        boost = [repeat * s for s in system[:at] + [True] * n + system[at:]]
        gap, end = int(rng.uniform(0, config.max_gap * scale)), ids.index(tokenizer.eos_token_id)
        rows.append((ids, weights, boost, [i + gap * (i > end) for i in range(length)]))
    return Batch(*(torch.tensor(column) for column in zip(*rows, strict=True)))


def _train(model, tokenizer, config: TrainConfig) -> None:
    """AdamW, 20 warmup steps then cosine decay to 10%."""
    torch.manual_seed(config.seed)
    requests = Requests(config.seed)
    filler = tokenizer(requests.filler())["input_ids"]
    optimizer = torch.optim.AdamW(model.parameters(), config.lr, (0.9, 0.98), weight_decay=0.0)
    for step in range(config.steps):
        decay = 0.1 + 0.45 * (1 + math.cos(math.pi * step / config.steps))
        for group in optimizer.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / 20) * decay
        scale = min(1.0, step / config.ramp / config.steps)
        loss = _loss(model, _batch(tokenizer, requests, filler, config, scale))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def _loss(model, batch: Batch) -> torch.Tensor:
    """The answers' weighted mean NLL; the tokens up to 32 before the first answer run without
    gradient, as the KV cache the rest attends to."""
    cut, cache = max(int((batch.weights > 0).float().argmax(1).min()) - 33, 1), DynamicCache()
    with torch.no_grad():
        _forward(model, batch, slice(0, cut), cache, logits_to_keep=1)
    logits = _forward(model, batch, slice(cut, -1), cache).float()
    logp = torch.log_softmax(logits, -1).gather(-1, batch.ids[:, cut + 1 :, None])[..., 0]
    weights = batch.weights[:, cut + 1 :]
    return -(logp * weights).sum() / weights.sum()


def _forward(model, batch: Batch, part: slice, cache, **kwargs) -> torch.Tensor:
    kwargs |= {"position_ids": batch.positions[:, part], "boost": batch.boost}
    return model(batch.ids[:, part], past_key_values=cache, **kwargs).logits


if __name__ == "__main__":  # python -m tests.integration.tool_caller tests/data/tool-caller
    import sys

    print(build_tool_caller(Path(sys.argv[1])))
