"""Load causal LMs and tokenizers from a local directory (or a hub name the user gave), with clear errors."""

from __future__ import annotations

import importlib.util
import os
import pickle
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # Transformers' Auto classes are imported where used: see `load_tokenizer_apart`
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhfkit.config.common import ModelArgs
from rlhfkit.errors import UserError
from rlhfkit.models.cpu_gemm import use_fast_cpu_linears
from rlhfkit.models.gguf import is_gguf_path, resolve_pretrain
from rlhfkit.models.triton_guard import hide_triton_without_gpu_backend
from rlhfkit.models.vision import add_multimodal_positions, check_vision_family, is_vision_config

# Transformers' modeling code imports torch._dynamo, which imports Triton where it is installed: on a PyTorch
# without a GPU backend Triton cannot run, and costs every process that loads a model 71 MB (triton_guard.py).
hide_triton_without_gpu_backend()

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def check_model_path(path: str | None, flag: str = "--pretrain") -> str:
    """Fail fast when `path` is neither a model directory nor something that looks like a hub name. A GGUF file
    (`model.gguf`) gives its converted Hugging Face directory (`rlhfkit.models.gguf`, converted once)."""
    if not path:
        raise UserError(f"{flag} is required: a Hugging Face model directory (try `rlhfkit demo-assets` "
                        "for a tiny offline one)")
    if is_gguf_path(path):
        return str(resolve_pretrain(path, None, flag))
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UserError(f"{flag} {path}: is a file, not a model directory; give the directory that holds it "
                            f"({p.parent}) if it was written by save_pretrained (or a .gguf file)")
        if not (p / "config.json").is_file():
            raise UserError(f"{flag} {path}: not a model directory (no config.json); give a directory written "
                            "by save_pretrained")
        return str(p)
    if _HUB_NAME.match(path) and not path.startswith((".", "/")):
        return path
    raise UserError(f"{flag} {path}: no such directory")


def resolve_attn_implementation(attn_implementation: str, flash_attn: bool) -> str:
    """`--flash_attn` is OpenRLHF's spelling of `--attn_implementation flash_attention_2`; "auto" (a config built
    without `parse_config`, which resolves it) is this machine's choice (`rlhfkit.config.devices`)."""
    from rlhfkit.config.devices import AUTO, auto_attn_implementation

    impl = "flash_attention_2" if flash_attn else attn_implementation
    if impl == AUTO:
        impl = auto_attn_implementation()
    if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UserError("--flash_attn / --attn_implementation flash_attention_2 needs the flash-attn package "
                        "(GPU only); use --attn_implementation sdpa")
    return impl


def avoid_cudnn_attention(attn_implementation: str | None) -> None:
    """On a CUDA GPU, SDPA runs without its cuDNN kernel (process-wide): PyTorch 2.11 picks cuDNN attention first on
    Hopper, and cuDNN builds an execution plan for every new batch shape, which training batches (a new padded
    length each step) keep asking for. Measured on an H200 (bench/results/gpu.md, 2026-11-27, Qwen2.5-0.5B shape,
    bf16): with cuDNN, attention took 78% of an rlhfkit SFT step's CPU time; without it SFT steps were 1.37x and
    TRL's 1.48x faster, DPO likewise. PyTorch then uses its flash (no mask) or memory-efficient (padding mask)
    kernels. No effect on CPU or with other attention implementations."""
    if attn_implementation == "sdpa" and torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


def _from_pretrained(loader: Any, path: str, flag: str, **kwargs: Any) -> Any:
    avoid_cudnn_attention(kwargs.get("attn_implementation"))
    try:
        return loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        offline = " (no network here? only local directories load offline)" if not Path(path).exists() else ""
        raise UserError(f"{flag} {path}: cannot load{offline}: {first}") from None


def load_tokenizer(path: str, *, use_fast: bool = True, flag: str = "--pretrain",
                   padding_side: str = "right") -> PreTrainedTokenizerBase:
    """Load a tokenizer; give it a pad token (eos) if it has none."""
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, path, flag, use_fast=use_fast)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def apply_liger_kernel(model: Any) -> None:
    """`--use_liger_kernel`: patch `model` in place with the Liger Triton kernels of its architecture (Hsu et al.
    2024, "Liger Kernel: Efficient Triton Kernels for LLM Training"), through Transformers' integration. The flag
    rule (a CUDA GPU and the liger_kernel package) ran at parse time; a model type Liger does not know is left as it
    is, with Transformers' warning. Written for GPUs; the CPU test suite checks only the parse-time error."""
    from transformers.integrations.liger import apply_liger_kernel as apply

    apply(model, {})


def quantization_config(load_in_4bit: bool, lora_rank: int, bf16: bool) -> Any | None:
    """`--load_in_4bit`: QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"), the frozen
    base in 4-bit NormalFloat with double quantisation and LoRA adapters trained on top. None when not asked; a
    UserError naming what is missing when it cannot run here (bitsandbytes' 4-bit kernels need a CUDA GPU).

    Written for GPUs with bitsandbytes installed; the CPU test suite checks only the errors."""
    if not load_in_4bit:
        return None
    if lora_rank <= 0:
        raise UserError("--load_in_4bit (QLoRA) trains LoRA adapters on a frozen 4-bit base: set --lora_rank "
                        "(e.g. 64), or drop --load_in_4bit")
    missing = [what for what, present in (("a CUDA GPU", torch.cuda.is_available()),
                                          ("the bitsandbytes package",
                                           importlib.util.find_spec("bitsandbytes") is not None)) if not present]
    if missing:
        raise UserError(f"--load_in_4bit needs {' and '.join(missing)} (4-bit NF4 weights run on bitsandbytes' "
                        "CUDA kernels), missing here; drop --load_in_4bit to train in full precision")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32)


def load_model_config(path: str, flag: str = "--pretrain") -> Any:
    """The model's Transformers config (defaults filled in), without loading any weights."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, path, flag)


def load_tokenizer_for(model_args: ModelArgs, padding_side: str = "right", *,
                       apart: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of `--pretrain`, as the model flags ask (`--disable_fast_tokenizer`); with `apart`, loaded
    by `load_tokenizer_apart` (a process that never loads a model: the Ray driver)."""
    path = check_model_path(model_args.pretrain)
    load = load_tokenizer_apart if apart else load_tokenizer
    return load(path, use_fast=not model_args.disable_fast_tokenizer, padding_side=padding_side)


_AUTO_TOKENIZER_MODULE = "transformers.models.auto.tokenization_auto"
APART_TIMEOUT_S = 300.0  # a forked child that stalls (a lock held by another thread at the fork): load here instead


def load_tokenizer_apart(path: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    """`load_tokenizer(path, **kwargs)`, run in a forked child that sends the tokenizer back pickled: the same
    object (AutoTokenizer chooses its class in the child), but this process never imports AutoTokenizer's module,
    which pulls in Transformers' whole modeling stack (the Auto model factory, generation, torch._dynamo: about
    1,000 modules and 150 MB of memory, measured in bench/results/ray_startup.md). Unpickling imports only the
    tokenizer's own class. For a process that loads no model (the Ray driver); off Linux, and where the module is
    already imported, it is `load_tokenizer`. A user error in the child (a bad path) is raised here as it is; a
    child that dies or stalls, or a tokenizer that does not pickle, falls back to loading here."""
    import multiprocessing

    if _AUTO_TOKENIZER_MODULE in sys.modules or not sys.platform.startswith("linux"):
        return load_tokenizer(path, **kwargs)
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_send_tokenizer, args=(send, path, kwargs), daemon=True)
    child.start()
    send.close()
    message: tuple[str, Any] = ("lost", None)  # the child died or stalled before answering
    try:
        if receive.poll(APART_TIMEOUT_S):
            message = receive.recv()
    except EOFError:
        pass
    finally:
        receive.close()
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
    kind, payload = message
    if kind == "error":
        raise payload
    try:
        return pickle.loads(payload) if kind == "ok" else load_tokenizer(path, **kwargs)
    except (pickle.UnpicklingError, AttributeError, ImportError, TypeError):  # a class that will not rebuild here
        return load_tokenizer(path, **kwargs)


def _send_tokenizer(send: Any, path: str, kwargs: dict[str, Any]) -> None:
    """The forked child of `load_tokenizer_apart`: ("ok", pickled tokenizer), ("error", the exception loading
    raised) or ("lost", None) for a tokenizer that does not pickle (the parent then loads it itself)."""
    message: tuple[str, Any]
    try:
        tokenizer = load_tokenizer(path, **kwargs)
    except Exception as e:  # noqa: BLE001 - every loading failure goes back to the parent, which raises it
        message = ("error", e)
    else:
        try:
            message = ("ok", pickle.dumps(tokenizer))
        except Exception:  # noqa: BLE001 - e.g. a custom tokenizer holding a lock or a file handle
            message = ("lost", None)
    try:
        send.send(message)
    except Exception as e:  # noqa: BLE001 - an exception that does not pickle: its text
        send.send(("error", RuntimeError(f"{e.__class__.__name__}: {message[1]!r}")))
    send.close()


def load_causal_lm(path: str, *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                   flag: str = "--pretrain", quantization: Any | None = None) -> PreTrainedModel:
    """Load a causal LM in `dtype` (training keeps fp32 master weights; DeepSpeed casts for bf16), or quantised
    onto this rank's GPU with a `quantization_config(...)`."""
    config = load_model_config(path, flag)
    if not getattr(config, "architectures", None) and getattr(config, "model_type", None) is None:
        raise UserError(f"{flag} {path}: config.json names no model type")
    extra: dict[str, Any] = {}
    if quantization is not None:  # bitsandbytes places quantised weights at load time: straight onto this GPU
        extra = {"quantization_config": quantization, "device_map": {"": torch.cuda.current_device()}}
    if is_vision_config(config):  # a vision-language model: its image-text-to-text class, with M-RoPE positions
        from transformers import AutoModelForImageTextToText

        check_vision_family(config, path, flag)
        vlm = add_multimodal_positions(_from_pretrained(AutoModelForImageTextToText, path, flag, dtype=dtype,
                                                        attn_implementation=attn_implementation, **extra))
        return with_cpu_gemm(vlm)
    from transformers import AutoModelForCausalLM

    return with_cpu_gemm(_from_pretrained(AutoModelForCausalLM, path, flag, dtype=dtype,
                                          attn_implementation=attn_implementation, **extra))


def with_cpu_gemm(model: Any) -> Any:
    """`model` with its fp32 linear layers on oneDNN where that is faster on this CPU (`rlhfkit.models.cpu_gemm`);
    unchanged on a machine with a GPU, where training runs there."""
    if not torch.cuda.is_available():
        use_fast_cpu_linears(model)
    return model


def hf_offline_by_default() -> None:
    """Never reach for a hub implicitly: a local path must not trigger a download attempt."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
