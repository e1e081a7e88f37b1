"""The default tokenizer built from the packaged GGUF's metadata (no weights, no torch)
tokenizes exactly like the tokenizer of the converted model."""

from __future__ import annotations

import json
import os

import pytest

from promptsplice import assets
from promptsplice.errors import AssetError


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A fresh build from the GGUF into a temporary cache (not the shared one)."""
    folder = tmp_path_factory.mktemp("tok") / "SmolLM2.tokenizer"
    assert assets.ensure_default_tokenizer(folder) == folder
    return folder


@pytest.fixture(scope="module")
def converted():
    from promptsplice.engine_adapters._model import ensure_default_model

    return ensure_default_model()


def test_gguf_tokenizer_matches_the_converted_model(built, converted):
    from tokenizers import Tokenizer

    from promptsplice.benchmarks.traces import load_wiki_leads

    ours = Tokenizer.from_file(str(built / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert json.loads(ours.to_str()) == json.loads(theirs.to_str())
    texts = [t for _, t in load_wiki_leads()[:300]]
    texts += ["  leading spaces\n\n\ttabs\r\n", "naïve café 東京 🙂 ĠĊ \u00a0", "x" * 3000, ""]
    specials = [t["content"] for t in json.loads(theirs.to_str())["added_tokens"]]
    assert len(specials) == 17 and "<|im_start|>" in specials
    texts += [f"a{s}b {s}\n" for s in specials] + ["".join(specials)]
    a = [e.ids for e in ours.encode_batch(texts, add_special_tokens=False)]
    b = [e.ids for e in theirs.encode_batch(texts, add_special_tokens=False)]
    assert a == b
    for s in specials:
        (only,) = ours.encode(s, add_special_tokens=False).ids
        assert only == theirs.token_to_id(s) and ours.decode([only], skip_special_tokens=False) == s
    assert ours.get_vocab_size() == theirs.get_vocab_size() == 49152


def test_gguf_chat_template_and_special_tokens_match(built, converted):
    from promptsplice.assembler import ChatTemplate

    ours, theirs = ChatTemplate.from_dir(built), ChatTemplate.from_dir(converted)
    assert ours.source == theirs.source
    want = {k: v for k, v in theirs.special_tokens.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    assert ours.special_tokens == want and want["bos_token"] == "<|im_start|>"
    cfg = json.loads((built / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "GPT2TokenizerFast"


@pytest.mark.reliability
def test_a_complete_folder_is_reused_an_empty_one_built_and_a_foreign_one_left_alone(built, tmp_path):
    """A folder without the marker was never built here (a build renames a complete
    folder into place): it was removed and rebuilt, deleting a user's hand-converted
    model or the parent folder ``PROMPTSPLICE_MODEL_DIR`` named."""
    stamp = (built / "tokenizer.json").stat().st_mtime_ns
    assert assets.ensure_default_tokenizer(built) == built
    assert (built / "tokenizer.json").stat().st_mtime_ns == stamp
    empty = tmp_path / "empty"
    empty.mkdir()
    assets.ensure_default_tokenizer(empty)
    assert assets.is_complete(empty) and json.loads((empty / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    models = tmp_path / "models"
    (models / "llama-3-8b").mkdir(parents=True)
    (models / "notes.txt").write_text("mine")
    with pytest.raises(AssetError, match="was not built by promptsplice .*left alone: point PROMPTSPLICE_MODEL_DIR"):
        assets.ensure_default_tokenizer(models)
    assert sorted(p.name for p in models.iterdir()) == ["llama-3-8b", "notes.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".models.build-")] == []


def test_a_users_converted_model_folder_is_used_as_it_is(monkeypatch, tmp_path):
    """``PROMPTSPLICE_MODEL_DIR`` at a folder the user converted (no marker): the engine
    and the tokenizer use it; nothing is built or removed."""
    from promptsplice.engine_adapters._model import ensure_default_model

    mine = tmp_path / "my-smollm2"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    (mine / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("PROMPTSPLICE_MODEL_DIR", str(mine))
    assert ensure_default_model() == mine and not assets.is_complete(mine)
    monkeypatch.setattr(assets, "gguf_path", lambda: (_ for _ in ()).throw(AssetError("no gguf package")))
    assert assets.ensure_default_tokenizer(tmp_path / "tok") == mine


def test_an_interrupted_build_leaves_no_temporary_folder(tmp_path):
    """Ctrl-C during a build (hundreds of MB of half-written weights for the model) left
    its temporary folder for good; one a killed build left is removed by the next."""
    folder = tmp_path / "tok"
    killed = tmp_path / ".tok.build-abc123"  # what SIGKILL leaves
    killed.mkdir()
    (killed / "model.safetensors").write_text("half")

    def interrupted(source, out):
        (out / "model.safetensors").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        assets.build_folder(folder, tmp_path / "src", interrupted)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tok.lock"]


def test_cache_locations_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMPTSPLICE_HOME", str(tmp_path))
    monkeypatch.delenv("PROMPTSPLICE_MODEL_DIR", raising=False)
    assert assets.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert assets.default_tokenizer_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct.tokenizer"


def test_a_home_that_cannot_hold_folders_is_an_asset_error(monkeypatch, tmp_path):
    """A file where PROMPTSPLICE_HOME's folders go (or a read-only home) raised a raw
    NotADirectoryError / FileExistsError from assemble_prompt."""
    blocker = tmp_path / "home"
    blocker.write_text("a file, not a folder")
    monkeypatch.setenv("PROMPTSPLICE_HOME", str(blocker))
    with pytest.raises(AssetError, match="cannot create .*home/models to build .*point PROMPTSPLICE_HOME"):
        assets.ensure_default_tokenizer()
    with pytest.raises(AssetError, match="cannot create"):
        assets.ensure_default_tokenizer(blocker / "tok")


def test_a_non_byte_level_gguf_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "_read_gguf_tokenizer", lambda source: {"tokenizer.ggml.model": "llama"})
    with pytest.raises(AssetError, match="not a GPT-2 byte-level BPE"):
        assets.ensure_default_tokenizer(tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_a_concurrent_build_that_finishes_first_wins(tmp_path):
    """Two processes building one folder: the one that finishes second keeps the
    first one's complete copy (it never deletes a folder that readers may be using)."""
    folder = tmp_path / "shared"

    def other_process_finishes_first(source, out):
        (out / "tokenizer.json").write_text("second")
        folder.mkdir()
        (folder / "tokenizer.json").write_text("first")
        (folder / ".complete").write_text(json.dumps({"stamp": "v1"}))  # the same converter's build

    assert assets.build_folder(folder, tmp_path / "src", other_process_finishes_first, "v1") == folder
    assert (folder / "tokenizer.json").read_text() == "first"
    # our temporary copy is gone (the builders' lock file stays: removing it could let two build)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shared.lock", "shared"]


@pytest.mark.reliability
def test_builders_of_one_folder_at_once_build_it_once_and_all_read_it(tmp_path):
    """Several threads (request threads on a cold start) building one missing folder:
    a late builder removed, as leftovers, the folder an early one had just completed
    and handed out ("Directory not empty", a missing tokenizer.json).  Now they take
    turns, and who waited uses the folder built meanwhile."""
    import threading
    import time
    from pathlib import Path

    builds, failures = [], []

    def build(source, tmp):
        builds.append(tmp)
        time.sleep(0.01)
        (tmp / "tokenizer.json").write_text(json.dumps({"ok": 1}))

    for trial in range(20):
        folder = tmp_path / f"t{trial}" / "tok"
        start = threading.Barrier(6)

        def go():
            start.wait()
            try:
                got = assets.build_folder(folder, Path("src"), build)
                json.loads((got / "tokenizer.json").read_text())
            except Exception as exc:  # noqa: BLE001 (counted: the assertion names them)
                failures.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=go) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []
    assert len(builds) == 20  # one build per folder


def test_a_built_folder_is_readable_by_other_users(tmp_path, monkeypatch):
    """Builds went through ``tempfile.mkdtemp`` (mode 0700): a cache built by one user (a
    container image's build step as root) was unreadable to the user serving, and that
    user got a raw PermissionError.  Now the folder has the umask's mode, and an
    unreadable one is an ``AssetError`` naming the fix (the tests run as root, which
    reads anything, so the refusal is made by wrapping ``Path.is_file``)."""
    import os
    import stat
    from pathlib import Path

    def build(src, out):  # as safetensors' save_file writes: 0600 whatever the umask
        (out / "t.json").write_text("{}")
        (out / "sub").mkdir(mode=0o700)
        (out / "sub" / "w.safetensors").write_bytes(b"w")
        os.chmod(out / "sub" / "w.safetensors", 0o600)

    old = os.umask(0o022)
    try:
        folder = assets.build_folder(tmp_path / "tok", tmp_path / "src", build)
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / "sub").stat().st_mode) == 0o755  # (0700 before)
    assert stat.S_IMODE((folder / "sub" / "w.safetensors").stat().st_mode) == 0o644  # (0600: unreadable to others)
    assert stat.S_IMODE((folder / "t.json").stat().st_mode) == 0o644

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", refused)
    with pytest.raises(AssetError, match="built by another user; make it readable"):
        assets.is_complete(folder)


def test_a_build_waiting_for_another_says_so(tmp_path, caplog):
    """A second builder waited on the lock without a word: a stopped ``make setup``
    (Ctrl-Z) held it, and ``make test`` hung at ``model prepare`` with no output."""
    import fcntl
    import logging
    import threading

    folder = tmp_path / "tok"
    with open(tmp_path / ".tok.lock", "a+b") as held:  # another builder, mid-build
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(b"4242\n")  # its pid, as a builder writes it
        held.flush()
        done = []
        with caplog.at_level(logging.WARNING, logger="promptsplice.assets"):
            t = threading.Thread(target=lambda: done.append(assets.build_folder(
                folder, tmp_path / "src", lambda src, out: (out / "t.json").write_text("{}"))))
            t.start()
            for _ in range(200):
                if any("waiting for another process building" in r.getMessage() for r in caplog.records):
                    break
                t.join(0.01)
            assert not done  # still waiting
            fcntl.flock(held, fcntl.LOCK_UN)
            t.join(10)
    assert done == [folder] and assets.is_complete(folder)
    assert any(str(tmp_path / ".tok.lock") in r.getMessage() and "process 4242" in r.getMessage()
               for r in caplog.records)
    assert (tmp_path / ".tok.lock").read_text() == f"{os.getpid()}\n"  # the last builder's


def test_a_builder_that_holds_the_lock_too_long_is_named_in_an_asset_error(tmp_path, monkeypatch):
    """A stopped builder (Ctrl-Z) held the lock for good and every later build hung."""
    import fcntl

    monkeypatch.setattr(assets, "BUILD_WAIT_S", 0.2)
    with open(tmp_path / ".tok.lock", "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(b"777\n")
        held.flush()
        with pytest.raises(AssetError, match=r"process 777 has held .*\.tok\.lock for over 0\.2 s.*resume or kill it"):
            assets.build_folder(tmp_path / "tok", tmp_path / "src", lambda src, out: None)
    assert not (tmp_path / "tok").exists()


def test_a_build_of_another_converter_or_gguf_is_rebuilt_and_kept_without_the_gguf(built, tmp_path, monkeypatch, caplog):
    """The marker held no version: a converter fix or a new GGUF release never rebuilt
    a cache built before it.  A build stamped otherwise (or not at all) is rebuilt; with
    no GGUF package to rebuild from, it still serves."""
    import logging
    import shutil

    source = assets.gguf_path()
    stamp = assets.tokenizer_stamp(source)
    assert assets.is_complete(built, stamp) and "tokenizer/" in stamp and f"{source.stat().st_size} bytes" in stamp
    old = tmp_path / "old.tokenizer"
    shutil.copytree(built, old)
    (old / ".complete").write_text(json.dumps({"source": str(source)}) + "\n")  # an older build's marker
    (old / "tokenizer.json").write_text("{}")  # and what it wrote
    assert assets.is_complete(old) and not assets.is_complete(old, stamp)
    with caplog.at_level(logging.WARNING, logger="promptsplice.assets"):
        assert assets.ensure_default_tokenizer(old) == old
    assert "rebuilding" in caplog.text and assets.is_complete(old, stamp)
    assert json.loads((old / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".old")) == [".old.tokenizer.lock"]
    # without the GGUF package an outdated build serves (nothing to rebuild it from)
    (old / ".complete").write_text(json.dumps({"source": str(source), "stamp": "tokenizer/0"}) + "\n")
    monkeypatch.setattr(assets, "gguf_path", lambda: (_ for _ in ()).throw(AssetError("no gguf package")))
    assert assets.ensure_default_tokenizer(old) == old and not assets.is_complete(old, stamp)


def test_the_model_is_ready_when_built_by_this_converter_or_the_users_own(tmp_path, monkeypatch):
    """``model prepare`` and the engine rebuild a conversion another converter made;
    a user's own folder (no marker) is never touched."""
    source = assets.gguf_path()
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    assert assets.model_ready(folder)  # the user's own
    (folder / ".complete").write_text(json.dumps({"source": str(source), "stamp": "weights/1"}) + "\n")
    assert not assets.model_ready(folder)
    stamp = assets.weights_stamp(source)
    assert stamp.startswith("weights/") and stamp != assets.tokenizer_stamp(source)
    assert "transformers" not in stamp  # two environments sharing a cache rebuilt each other's weights
    (folder / ".complete").write_text(json.dumps({"source": str(source), "stamp": stamp}) + "\n")
    assert assets.model_ready(folder)
    (folder / ".complete").write_text("not json")
    assert not assets.model_ready(folder)
    monkeypatch.setattr(assets, "gguf_path", lambda: (_ for _ in ()).throw(AssetError("no gguf package")))
    assert assets.model_ready(folder)


def test_an_outdated_build_that_cannot_be_rebuilt_still_serves(built, tmp_path, monkeypatch, caplog):
    """A read-only cache built before the stamps: every first assembly raised AssetError.
    (The refusal is injected: this suite runs as root, which writes anywhere.)"""
    import contextlib
    import logging
    import shutil

    old = tmp_path / "old.tokenizer"
    shutil.copytree(built, old)
    (old / ".complete").write_text(json.dumps({"source": "x"}) + "\n")  # no stamp: outdated

    @contextlib.contextmanager
    def read_only(folder):
        raise AssetError(f"cannot open the lock to build {folder}: read-only file system")
        yield

    monkeypatch.setattr(assets, "_build_lock", read_only)
    with caplog.at_level(logging.WARNING, logger="promptsplice.assets"):
        assert assets.ensure_default_tokenizer(old) == old
    assert "serving" in caplog.text and "read-only" in caplog.text
    with pytest.raises(AssetError, match="read-only"):  # nothing built there yet: no fallback
        assets.ensure_default_tokenizer(tmp_path / "new.tokenizer")
