"""Tiny pretrained Hugging Face checkpoints for tests: weights, config and a chat tokenizer, saved locally.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few
sentences, with a ChatML-style template, so a test can fine-tune a "pretrained" model
through the CLI exactly as a user would fine-tune a real one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def chat_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` short chats of varied length (one or two exchanges)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in torch.randint(0, 50, (2,), generator=g))
        turns = [{"role": "user", "content": f"what is {a} plus {b}?"},
                 {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "answer briefly"}, *turns,
                     {"role": "user", "content": "and times two?"},
                     {"role": "assistant", "content": f"that is {2 * (a + b)}."}]
        out.append({"messages": turns})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def save_tokenizer(out: Path, vocab_size: int = 280) -> None:
    """A byte-level BPE tokenizer with BOS/EOS, ChatML markers and the chat template, saved under ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [r["messages"][i]["content"] for r in chat_records(200, seed=99) for i in range(len(r["messages"]))]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="</s>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def save_pretrained_model(out: Path, arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                          max_shard_size: str | None = None, vocab_size: int = 288) -> Path:
    """A tiny randomly initialised ``arch`` (llama | qwen2) saved with ``save_pretrained`` plus the tokenizer."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=3, pad_token_id=1, tie_word_embeddings=False)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=10000.0))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=1000000.0))
    else:
        raise ValueError(arch)
    model.to(dtype).save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    save_tokenizer(out)
    return out
