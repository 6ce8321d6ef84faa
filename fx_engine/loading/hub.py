"""Models by name: `org/name` (a Hugging Face folder of safetensors) or `org/name:QUANT`
(a GGUF repo, llama.cpp's `-hf` form), resolved through `huggingface_hub`.

    resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")          -> the cached snapshot folder
    resolve_model("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")   -> the .gguf file (first shard)

Order, as mlx-lm and transformers users expect: a local path wins; then the Hugging Face
cache (`HF_HOME` / `HF_HUB_CACHE`, as laid out by huggingface_hub: what those tools already
downloaded), used as is when it holds what the request needs; then, unless offline
(`HF_HUB_OFFLINE=1`), the Hub (`HF_ENDPOINT`, a token from `HF_TOKEN` or `hf auth login`)
through huggingface_hub's own download path, with its progress bars on a terminal only.
`revision` pins a branch, tag or commit. An id that cannot be resolved raises
`ModelNotFound` saying what was tried.

Only what loading reads is fetched: for a folder its JSON files, safetensors, and tokenizer
files (no PyTorch `.bin` duplicates, no ONNX); for a GGUF repo the chosen quantization's
file, every shard of a split file (`PREFIX-00001-of-0000N.gguf`), and no `mmproj` projector.
Without a `:QUANT` a GGUF-only repo gets Q4_K_M when it has it (llama.cpp's default), its
only model file otherwise, and else an error listing the choices.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path
from typing import Any

from fx_engine.loading.default_model import ModelNotFound

__all__ = ["resolve_model", "parse_model_id", "choose_gguf", "cached_snapshot", "ModelNotFound"]

# a repo id: owner/name of letters, digits, "-", "_", "." (the Hub's rule), optional :QUANT
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+))?$")
# what loading a folder reads (fx_engine.loading.weights / tokenizer / chat_template)
FOLDER_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.jinja",
                   "merges.txt", "vocab.txt"]
DEFAULT_QUANT = "Q4_K_M"
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def parse_model_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, quant or None) when `spec` reads as `org/name[:QUANT]`, else None."""
    m = _REPO_ID.match(spec.strip())
    if m is None or spec.startswith((".", "/", "~")) or m["repo"].count("/") != 1:
        return None
    if m["repo"].lower().endswith((".gguf", ".safetensors", ".json")):
        return None  # a file path (dir/model.gguf), not a repo
    return m["repo"], (m["quant"] or None)


def _model_gguf(name: str) -> bool:
    base = name.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and "mmproj" not in base


def _sets(files: list[str]) -> dict[str, list[str]]:
    """GGUF model files grouped into loadable units: a single file, or a split file's shards
    (keyed by the first shard's path), in order."""
    units: dict[str, list[str]] = {}
    for f in sorted(f for f in files if _model_gguf(f)):
        m = _SHARD.match(f)
        key = f if m is None else f"{m['prefix']}-00001-of-{m['count']}.gguf"
        units.setdefault(key, []).append(f)
    return units


def _quant_tag(quant: str) -> re.Pattern[str]:
    # the tag between separators: "Q4_K_M" in "model-Q4_K_M.gguf" or "Q4_K_M/model-00001-of-..."
    # but not "Q4_K" inside "Q4_K_M" nor "Q4_0" inside "IQ4_0"
    return re.compile(rf"(?:^|[-_./]){re.escape(quant)}(?=[-./]|$)", re.IGNORECASE)


def choose_gguf(files: list[str], quant: str | None, repo: str = "") -> list[str]:
    """The GGUF file(s) to fetch from a repo's file list for `quant` (None: the default
    choice); every shard of a split file. Errors list the quantizations on offer."""
    units = _sets(files)
    if not units:
        raise ModelNotFound(f"{repo}: the repository has no .gguf model file"
                            + (f" (asked for :{quant})" if quant else ""))
    if quant is not None:
        tag = _quant_tag(quant)
        hits = [k for k in units if tag.search(k)]
        if len(hits) != 1:
            how = "no file" if not hits else f"{len(hits)} files ({', '.join(hits)})"
            raise ModelNotFound(f"{repo}:{quant}: {how} of that quantization; the repository has: "
                                f"{', '.join(units)}")
        return units[hits[0]]
    if len(units) == 1:
        return next(iter(units.values()))
    default = [k for k in units if _quant_tag(DEFAULT_QUANT).search(k)]
    if len(default) == 1:
        return units[default[0]]
    raise ModelNotFound(f"{repo}: {len(units)} GGUF files; choose one with {repo}:QUANT "
                        f"(files: {', '.join(units)})")


# PyTorch's weight files, which only a drafter head's folder may hold instead of
# safetensors (`resolve_model(..., torch_bins=True)`; read by loading.torch_pickle)
TORCH_BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def _folder_ready(folder: Path, torch_bins: bool = False) -> bool:
    """Whether a cached snapshot holds a loadable Hugging Face folder: config.json and every
    safetensors file its index names (or one safetensors file when unsharded); with
    torch_bins, PyTorch's pytorch_model*.bin likewise when there are no safetensors."""
    from fx_engine.core.checkpoint import WeightsError
    from fx_engine.loading.weights import index_shards

    if not (folder / "config.json").is_file():
        return False
    kinds = [("model.safetensors.index.json", "*.safetensors")]
    if torch_bins:
        kinds.append(("pytorch_model.bin.index.json", "pytorch_model*.bin"))
    for index_name, pattern in kinds:
        index = folder / index_name
        if index.is_file():
            try:
                index_shards(index)
            except WeightsError:
                return False
            return True
        if any(folder.glob(pattern)):
            return True
    return False


def cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of repo@revision, or None (nothing cached). Read from the
    cache's own layout (refs/<revision> names the commit, snapshots/<commit> holds the files)
    rather than snapshot_download(local_files_only=True): recent huggingface_hub versions
    refuse a snapshot that lacks files we never asked for (weights in other formats)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    root = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    rev = revision or "main"
    ref = root / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snap = root / "snapshots" / commit
    return snap if snap.is_dir() else None


def _local_files(folder: Path) -> list[str]:
    return sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file() or f.is_symlink())


def _from_cache(repo: str, quant: str | None, revision: str | None, tried: list[str],
                torch_bins: bool = False) -> Path | None:
    from huggingface_hub import constants

    snap = cached_snapshot(repo, revision)
    if snap is None:
        tried.append(f"the Hugging Face cache ({constants.HF_HUB_CACHE}): no snapshot of {repo}"
                     f" at revision {revision or 'main'}")
        return None
    files = _local_files(snap)
    ggufs = _sets(files)
    if quant is not None or (ggufs and not _folder_ready(snap, torch_bins)):
        try:
            chosen = choose_gguf(files, quant, repo)
        except ModelNotFound as e:
            tried.append(f"the cached snapshot {snap}: {e}")
            return None
        if all((snap / f).exists() for f in chosen):
            return snap / chosen[0]
        tried.append(f"the cached snapshot {snap}: shards missing")
        return None
    if _folder_ready(snap, torch_bins):
        return snap
    tried.append(f"the cached snapshot {snap}: no config.json with its safetensors"
                 + (" or pytorch_model.bin" if torch_bins else ""))
    return None


def _progress(enabled: bool | None) -> Any:
    """A context that turns huggingface_hub's download bars on only on a terminal (or as
    asked): quiet in logs and pipes."""
    import contextlib

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    show = sys.stderr.isatty() if enabled is None else enabled

    @contextlib.contextmanager
    def scope() -> Any:
        was = are_progress_bars_disabled()
        (enable_progress_bars if show else disable_progress_bars)()
        try:
            yield
        finally:
            (disable_progress_bars if was else enable_progress_bars)()
    return scope()


def _download(repo: str, quant: str | None, revision: str | None, progress: bool | None,
              torch_bins: bool = False) -> Path:
    from huggingface_hub import HfApi, snapshot_download

    with _progress(progress):
        files = HfApi().list_repo_files(repo, revision=revision)
        weights = any(f.endswith(".safetensors") for f in files)
        bins = torch_bins and not weights and any(fnmatch.fnmatch(f, TORCH_BIN_PATTERNS[0]) for f in files)
        ready = "config.json" in files and (weights or bins)
        if quant is not None or (not ready and _sets(files)):
            chosen = choose_gguf(files, quant, repo)
            snap = Path(snapshot_download(repo, revision=revision, allow_patterns=chosen))
            return snap / chosen[0]
        if not ready:
            raise ModelNotFound(f"{repo}: neither a model folder (config.json with safetensors) "
                                f"nor GGUF files (the repository has: {', '.join(files[:20])})")
        snap = Path(snapshot_download(repo, revision=revision,
                                      allow_patterns=FOLDER_PATTERNS + (TORCH_BIN_PATTERNS if bins else [])))
    if not _folder_ready(snap, torch_bins):
        raise ModelNotFound(f"{repo}: downloaded to {snap}, but it has no config.json with its "
                            "safetensors")
    return snap


def resolve_model(spec: str | Path, *, revision: str | None = None,
                  progress: bool | None = None, torch_bins: bool = False) -> Path:
    """A local path for a model given as a path, `org/name`, or `org/name:QUANT`.

    revision: a branch, tag or commit of the repo (None: main). progress: download bars
    (None: only when stderr is a terminal). torch_bins: a folder whose weights are PyTorch's
    pytorch_model*.bin (no safetensors) also resolves (drafter heads: loading/drafter.py)."""
    p = Path(spec).expanduser()
    if p.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to a Hugging Face repo id, but "
                             f"{str(spec)!r} is a local path")
        return p
    parsed = parse_model_id(str(spec))
    if parsed is None:
        raise ModelNotFound(f"model path does not exist: {spec} (and it is not a Hugging Face "
                            "repo id, org/name or org/name:QUANT)")
    repo, quant = parsed
    from huggingface_hub import constants

    tried: list[str] = [f"a local path ./{spec}: none"]
    found = _from_cache(repo, quant, revision, tried, torch_bins)
    if found is not None:
        return found
    if constants.HF_HUB_OFFLINE:
        tried.append("the Hub: not tried, HF_HUB_OFFLINE is set")
    else:
        try:
            return _download(repo, quant, revision, progress, torch_bins)
        except ModelNotFound as e:
            tried.append(f"the Hub ({constants.ENDPOINT}): {e}")
        except Exception as e:  # noqa: BLE001 - HTTP, connection (httpx's own classes), disk: all say what failed
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            tried.append(f"the Hub ({constants.ENDPOINT}): {type(e).__name__}: {reason}")
    raise ModelNotFound(f"cannot resolve model {spec!r}" + (f" at revision {revision}" if revision else "")
                        + "; tried " + "; ".join(tried))
