"""The tiny checkpoints' tokenizer: byte-level BPE trained (in milliseconds, no network) on the
public-domain test text, wrapped as a transformers fast tokenizer with a ChatML template.

Deterministic: the same merges and the same tokenizer.json bytes on every run (the trainer
breaks ties by token id). Byte-level, so any text encodes; ids 0-2 are the special tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvmesh.errors import InvalidRequestError
from kvmesh_apps.tools.tiny_configs import TokenIds

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "public_domain.txt"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_VOCAB = 1024  # the ~3.5 KB text yields fewer merges (567 tokens in all)
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(text: str | None = None) -> Any:
    """A `PreTrainedTokenizerFast`: eos <|im_end|>, pad <|endoftext|>, no BOS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_VOCAB,
        min_frequency=2,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_training_text() if text is None else text], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def _training_text() -> str:
    if not TEXT.is_file():
        raise InvalidRequestError(
            f"the tiny tokenizer trains on {TEXT}: run from a source checkout"
        )
    return TEXT.read_text(encoding="utf-8")


def token_ids(tokenizer: Any) -> TokenIds:
    ids = tokenizer.convert_tokens_to_ids(list(SPECIALS))
    return TokenIds(vocab_size=len(tokenizer), bos=ids[0], eos=ids[2], pad=ids[0])


def save_tokenizer(tokenizer: Any, output: Path) -> None:
    """tokenizer.json + tokenizer_config.json (the chat template inside it, not a .jinja file)."""
    tokenizer.save_pretrained(str(output), save_jinja_files=False)
