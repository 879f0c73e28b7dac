"""The embedded default model: local BPE tokenizer, seeded random weights; records its tokenizer
class.

The embedded default model: a tiny decoder-only LM with seeded random weights and a
byte-level BPE tokenizer trained locally, saved as a standard HuggingFace checkpoint.

Nothing is downloaded: the tokenizer is trained on a small built-in corpus, the weights are
drawn from a seeded generator with a wide initializer range (0.2) so greedy output is varied
rather than one repeated token.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from pdtb.engine.tokenizer import record_tokenizer_class, recorded_class

ARCHS = ("llama", "qwen2", "mistral")
DEFAULT_ARCH = "llama"
DEFAULT_SEED = 0
DEFAULT_VOCAB = 512
# Model sizes `pdtb model init --size` writes. "tiny" is the embedded model (head size 32, the
# least vLLM's CPU attention takes); "head64" is a 12M-parameter model of the head size most
# released checkpoints have, for comparisons whose kernels treat head sizes differently.
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    "head64": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                   num_key_value_heads=2),
}
MAX_POSITIONS = 4096

_CORPUS = """\
In a shared inference pool a long request holds many times the memory of a short one.
The scheduler counts each request as one slot, yet the pages tell another story.
Prefill runs the prompt once and writes keys and values into pages of a pool.
Decode reads every page of a request at every step and writes one more token.
Tenants share the pool; quotas, weights and priorities decide who waits.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = < > ( ) [ ] { } : ; , .
def step(batch): return [sample(logits) for logits in model(batch)]
Héllo wörld, ça va? Grüße aus Zürich. 東京 와 서울 — emoji 🙂 and ünïcödé text.
"""


# A ChatML-like template in plain text (the tiny tokenizer has no role tokens), so the embedded
# model serves /v1/chat/completions as a real instruction-tuned checkpoint would.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves and finds a template


def cache_root() -> Path:
    """The project's cache directory (PDTB_CACHE_DIR overrides it): the embedded model, the
    CPU attention kernel's build."""
    return Path(os.environ.get("PDTB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pd-testbed"))


def default_model_dir() -> Path:
    """Cache directory of the embedded default model."""
    return cache_root() / f"tiny-{DEFAULT_ARCH}-seed{DEFAULT_SEED}"


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>")


def _config(arch: str, vocab_size: int, tokenizer, size: str = "tiny"):
    import transformers

    common = dict(
        vocab_size=vocab_size, **SIZES[size], max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


def init_tiny_model(out_dir: str | Path, arch: str = DEFAULT_ARCH, seed: int = DEFAULT_SEED,
                    size: str = "tiny") -> Path:
    """Write a small checkpoint (config, safetensors weights, tokenizer) of one of SIZES into `out_dir`."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {tuple(SIZES)}")
    out = Path(out_dir)
    tokenizer = _train_tokenizer(DEFAULT_VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab = len(tokenizer)
    config = _config(arch, vocab, tokenizer, size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "pdtb.json").write_text(json.dumps({"embedded": size == "tiny", "arch": arch, "seed": seed, "size": size}))
    record_tokenizer_class(out)  # lets the router skip transformers (and torch) when that is exact
    return out


def ensure_default_model() -> Path:
    """Create the embedded default model on first use; reuse it afterwards."""
    path = default_model_dir()
    if (path / "pdtb.json").exists():
        if not (path / CHAT_TEMPLATE_FILE).exists():  # made before the embedded model had one
            tmp = path / f"{CHAT_TEMPLATE_FILE}.tmp{os.getpid()}"
            tmp.write_text(CHAT_TEMPLATE)
            os.replace(tmp, path / CHAT_TEMPLATE_FILE)
        if recorded_class(path) is None:  # made before the record, or under another transformers
            record_tokenizer_class(path)
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    init_tiny_model(tmp)
    try:
        os.replace(tmp, path)  # atomic: concurrent first uses cannot see a half-written dir
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return path
