"""What `--model` names: a checkpoint folder, or a Hugging Face repo id (`Org/Name`, optionally
`Org/Name@revision`) resolved through huggingface_hub -- its cache (HF_HOME, HF_HUB_CACHE), read
only when HF_HUB_OFFLINE is set, else downloaded (snapshot_download, with its progress bars) or
brought up to date. Either way the folder is checked before anything loads: a folder that is not
a Qwen3-Omni checkpoint is one ConfigError line saying what is missing."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from voxpipe.errors import ConfigError

log = logging.getLogger(__name__)

MODEL_TYPE = "qwen3_omni_moe"
# what the tokenizer loader (services/thinker/tokenizer.py) reads: the fast tokenizer, or its BPE files
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))
# the files a process that reads no weights needs (the gateway: config, tokenizer, chat template,
# feature extractor)
NO_WEIGHT_PATTERNS = ["*.json", "*.txt", "*.jinja", "*.model"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def hub_name(name: str) -> str | None:
    """The repo id `name` is resolved from (the served model name clients see), None for a folder."""
    return name.partition("@")[0] if not Path(name).expanduser().exists() and is_repo_id(name) else None


def resolve_model(name: str, *, weights: bool = True) -> Path:
    """The local checkpoint folder `name` stands for, checked (`weights`: its safetensors too). A
    config .json file (--load-format dummy) is returned as it is."""
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".json":
        return path
    if path.is_dir():
        return check_checkpoint(path, weights=weights)
    if not is_repo_id(name):
        raise ConfigError(f"--model {name}: no such folder, and not a Hugging Face repo id (Org/Name)")
    return check_checkpoint(_from_hub(name, weights), weights=weights, name=name)


def _from_hub(name: str, weights: bool) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    repo_id, _, revision = name.partition("@")
    offline = constants.HF_HUB_OFFLINE
    patterns = None if weights else NO_WEIGHT_PATTERNS
    try:
        if not offline:
            log.info("--model %s: fetching%s into %s", name, "" if weights else " (config and tokenizer only)",
                     constants.HF_HUB_CACHE)
        folder = snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns,
                                   local_files_only=offline)
    except LocalEntryNotFoundError:
        if offline:
            raise ConfigError(f"--model {name}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                              f"HF_HUB_OFFLINE is set: download it first (hf download {repo_id}) or unset "
                              "HF_HUB_OFFLINE") from None
        raise ConfigError(f"--model {name}: the Hugging Face Hub cannot be reached and the cache "
                          f"({constants.HF_HUB_CACHE}) does not have it") from None
    except GatedRepoError:
        raise ConfigError(f"--model {name}: the repository is gated: accept its terms on huggingface.co and "
                          "log in (hf auth login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"--model {name}: no such Hugging Face repository (or it is private: log in with "
                          "hf auth login, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"--model {name}: no revision {revision!r} in {repo_id}") from None
    except OSError as e:      # disk full, permissions on the cache
        raise ConfigError(f"--model {name}: could not write the Hugging Face cache ({e})") from None
    log.info("--model %s: %s", name, folder)
    return Path(folder)


def check_checkpoint(folder: Path, *, weights: bool = True, name: str | None = None) -> Path:
    """`folder` if it holds a Qwen3-Omni checkpoint (config.json of model_type qwen3_omni_moe; with
    `weights` also a tokenizer and every safetensors shard its index lists, or at least one
    safetensors file); ConfigError listing what is missing otherwise."""
    where = f"--model {name} ({folder})" if name else f"--model {folder}"
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"{where} is not a checkpoint folder: config.json is missing")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{where}: config.json is not a JSON object ({e})") from None
    if model_type != MODEL_TYPE:
        raise ConfigError(f"{where} is not a Qwen3-Omni checkpoint: config.json's model_type is {model_type!r}, "
                          f"not {MODEL_TYPE!r}")
    missing = []
    if weights:       # without (dummy weights, the gateway) a folder may hold only config.json: the byte tokenizer
        if not any(all((folder / f).is_file() for f in files) for files in TOKENIZER_FILES):
            missing.append("the tokenizer (tokenizer.json, or vocab.json and merges.txt)")
        missing += _missing_weights(folder)
    if missing:
        raise ConfigError(f"{where} is not a complete Qwen3-Omni checkpoint: missing {'; '.join(missing)}")
    return folder


def _missing_weights(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return [] if any(folder.glob("*.safetensors")) else ["the weights (*.safetensors)"]
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"a readable model.safetensors.index.json ({type(e).__name__})"]
    absent = [s for s in shards if not (folder / s).is_file()]
    if not absent:
        return []
    shown = ", ".join(absent[:4]) + (f" and {len(absent) - 4} more" if len(absent) > 4 else "")
    return [f"{len(absent)} of the {len(shards)} weight shards the index lists ({shown})"]
