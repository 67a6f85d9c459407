"""Model names that are Hugging Face hub ids (``Qwen/Qwen2.5-0.5B-Instruct``): resolved to a
local snapshot through ``huggingface_hub.snapshot_download``, which honours HF_HUB_OFFLINE,
HF_HOME / HF_HUB_CACHE and HF_TOKEN as every Hugging Face tool does."""

from __future__ import annotations

import re
from pathlib import Path

from kvledger.errors import ConfigError

# What a model needs; *.bin only when the repo has no safetensors (checked after listing).
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name


def resolve_model_path(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> str:
    """A local folder as given; a hub id as its snapshot (downloaded unless cached)."""
    if Path(model).exists() or not looks_like_repo_id(model):
        if revision is not None and not Path(model).exists():
            raise ConfigError(f"--revision applies to hub ids; {model!r} is neither one nor a folder")
        return model
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ConfigError(f"{model!r} is not a folder, and huggingface_hub is not installed") from None
    kw = {"revision": revision, "cache_dir": download_dir}
    try:
        path = snapshot_download(model, allow_patterns=_PATTERNS, **kw)
        if not any(Path(path).glob("*.safetensors")):
            path = snapshot_download(model, allow_patterns=[*_PATTERNS, "*.bin"], **kw)
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"model {model!r}{f' at revision {revision!r}' if revision else ''} is not in the "
            "Hugging Face cache and cannot be downloaded (HF_HUB_OFFLINE is set or the hub is "
            "unreachable); give a model folder, or download it first"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise ConfigError(
            f"model {model!r} is neither a folder nor a hub repository you can read"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"model {model!r} has no revision {revision!r}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot fetch model {model!r} from the hub: {e}") from None
    return str(path)
