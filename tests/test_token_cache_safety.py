"""The token cache trusts nothing it finds on disk: a planted pickle in a partial build is never
unpickled, a damaged partial build starts over, a damaged entry is rebuilt to the same tokens, the
filters' checkpoints are arrays and JSON only, and a cache folder that cannot be written is one line
of bad input."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmlab import manifest
from lmlab.api import Filter
from lmlab.prepare import checkpoint, entry, pipeline, shards
from lmlab.prepare import tokens as token_cache
from support import StopAfter, run_cli


def write_corpus(tmp_path: Path, n: int = 240) -> Path:
    """Documents of about 60 bytes; from the 100th on, every third repeats an earlier one, so that
    exact-dedup drops documents after any checkpoint because of documents before it."""
    texts = [f"document {i:03d}: " + " ".join(f"w{(i * 7 + j) % 53}" for j in range(10)) for i in range(100)]
    texts += [texts[(i * 7) % 100] if i % 3 == 0 else f"later {i:03d} " + "x" * (i % 40) for i in range(100, n)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def write_manifest(tmp_path: Path, filters: str = '["exact-dedup"]', tokenizer: str = "char") -> Path:
    corpus = write_corpus(tmp_path)
    path = tmp_path / "dedup.toml"
    path.write_text(f'name = "dedup"\n[data]\nuse = "jsonl"\npath = "{corpus}"\n[tokenizer]\nuse = "{tokenizer}"\n'
                    f'[filter]\nuse = {filters}\n[tracker]\nuse = "none"\n')
    return path


def variant_of(path: Path):
    (variant,) = manifest.load(path, [])
    return variant


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def quiet(event: str, info: dict) -> None:
    pass


class Planted:
    """Unpickling it creates the marker file: proof that something unpickled it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


PARTS = 0.002  # shard_mb: parts of 2 kB, several per corpus


def interrupted(variant, root: Path, parts: int = 3) -> Path:
    """The partial folder of a build of ``variant`` stopped while filtering, after ``parts`` parts."""
    with pytest.raises(KeyboardInterrupt):
        pipeline.prepare_corpus(variant, root=root, workers=1, shard_mb=PARTS, listener=StopAfter("part", parts))
    (partial,) = (p for p in (root / "partial").iterdir() if p.is_dir())
    return partial


# -- the filter stage's checkpoints -----------------------------------------------------------------

def test_an_exact_dedup_build_interrupted_while_filtering_resumes_from_arrays_to_identical_shards(tmp_path):
    variant = variant_of(write_manifest(tmp_path))
    reference = pipeline.prepare_corpus(variant, root=tmp_path / "reference", workers=1, shard_mb=PARTS, listener=quiet)
    partial = interrupted(variant, tmp_path / "cache")
    state = json.loads((partial / "state.json").read_text())
    saved = partial / state["checkpoint"]["file"]
    assert saved.suffix == ".npz" and not list(partial.glob("*.pkl"))
    assert 100 < state["consumed"] < 200  # duplicates of documents before the checkpoint are still to come
    with np.load(saved, allow_pickle=False) as npz:  # arrays only: loads without unpickling anything
        assert npz["filter0-0"].dtype == np.uint8 and npz["filter0-0"].shape[1] == 16
    events = []
    resumed = pipeline.prepare_corpus(variant, root=tmp_path / "cache", workers=1, listener=lambda e, i: events.append(e))
    assert events[0] == "resume"
    assert files_of(resumed) == files_of(reference)
    assert json.loads((reference / "index.json").read_text())["filters"]["exact-dedup"]["documents_dropped"] == 46


class FirstCopies(Filter):
    """A corpus-level filter without ``state_dict``: keeps the first copy of each text."""

    name = "first-copies"
    corpus_level = True

    def __init__(self, options=None):
        super().__init__(options)
        self.seen = set()

    def signature(self, text: str) -> str:
        return text

    def admit(self, text: str) -> bool:
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


def test_a_corpus_level_filter_without_state_is_not_checkpointed_and_filters_again_from_the_start(tmp_path):
    variant = variant_of(write_manifest(tmp_path)).with_plugin("filter", FirstCopies)
    reference = pipeline.prepare_corpus(variant, root=tmp_path / "reference", workers=1, shard_mb=PARTS, listener=quiet)
    partial = interrupted(variant, tmp_path / "cache")
    state = json.loads((partial / "state.json").read_text())
    assert state["consumed"] == 0 and state["checkpoint"] is None and not list(partial.glob("filters-*"))
    resumed = pipeline.prepare_corpus(variant, root=tmp_path / "cache", workers=1, listener=quiet)
    assert files_of(resumed) == files_of(reference)


class Everything(FirstCopies):
    def state_dict(self) -> dict:
        return {"lengths": np.array(sorted(map(len, self.seen)), dtype=np.int64),
                "nested": [{"a": np.arange(3, dtype=np.float32), "b": None}, "text", 1.5, True]}


def test_a_state_of_arrays_and_json_values_comes_back_from_a_checkpoint_as_it_was_saved(tmp_path):
    saving = Everything()
    saving.seen = {"abc", "a", "ab"}
    received = []
    loading = Everything()
    loading.load_state_dict = received.append
    pending = (((b"prompt ", 0), ("répons".encode(), 1)), False, 1.0)
    description = checkpoint.save(tmp_path, "filters-00001.npz", {2: ("everything", saving)}, pending)
    json.dumps(description)  # what state.json holds
    assert checkpoint.load(tmp_path, description, {2: ("everything", loading)}) == pending
    (state,) = received
    np.testing.assert_array_equal(state["lengths"], [1, 2, 3])
    np.testing.assert_array_equal(state["nested"][0]["a"], [0, 1, 2])
    assert state["nested"][0]["a"].dtype == np.float32 and state["nested"][1:] == ["text", 1.5, True]


@pytest.mark.parametrize("state", [{"lengths": {1, 2}}, {"x": np.array([object()])}, {1: "a"}])
def test_a_state_that_is_not_arrays_and_json_values_is_refused_naming_the_filter(tmp_path, state):
    f = FirstCopies()
    f.state_dict = lambda: state
    with pytest.raises(TypeError, match="filter 'first-copies'"):
        checkpoint.save(tmp_path, "filters-00001.npz", {0: ("first-copies", f)}, None)


# -- planted and damaged partial builds -------------------------------------------------------------

def plant_pickle_blob(partial: Path, marker: Path, key: str) -> None:
    """A partial build of the format before this one: state.json naming a pickle of the filters."""
    for path in partial.glob("*"):
        if path.is_file():
            path.unlink()
    (partial / "filters-00003.pkl").write_bytes(pickle.dumps(Planted(marker)))
    (partial / "state.json").write_text(json.dumps({"format": 2, "key": key, "stage": "filter", "parts": [],
                                                    "blob": "filters-00003.pkl"}))


def plant_pickle_npz(partial: Path, marker: Path, key: str) -> None:
    """This format's checkpoint, with a pickle in an object array where the filter's state goes and the
    right SHA-256 in state.json: only np.load's refusal of pickles stands between it and the marker."""
    state = json.loads((partial / "state.json").read_text())
    name = state["checkpoint"]["file"]
    with open(partial / name, "wb") as f:
        np.savez(f, **{"filter0-0": np.array([Planted(marker)], dtype=object),
                       "pending": np.frombuffer(b"x", np.uint8)}, allow_pickle=True)
    state["checkpoint"]["sha256"] = shards.sha256_file(partial / name)
    (partial / "state.json").write_text(json.dumps(state))


def plant_pickle_as_npz(partial: Path, marker: Path, key: str) -> None:
    """A bare pickle under the checkpoint's name."""
    state = json.loads((partial / "state.json").read_text())
    name = state["checkpoint"]["file"]
    (partial / name).write_bytes(pickle.dumps(Planted(marker)))
    state["checkpoint"]["sha256"] = shards.sha256_file(partial / name)
    (partial / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("plant", [plant_pickle_blob, plant_pickle_npz, plant_pickle_as_npz])
def test_a_pickle_planted_in_a_partial_build_is_never_unpickled(tmp_path, plant):
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Planted(control)))
    assert control.exists()  # the payload is live: whatever unpickled it would leave its marker
    path = write_manifest(tmp_path)
    variant = variant_of(path)
    reference = pipeline.prepare_corpus(variant, root=tmp_path / "reference", workers=1, listener=quiet)
    root = tmp_path / "shared"
    partial = interrupted(variant, root)
    marker = tmp_path / "unpickled"
    plant(partial, marker, partial.name)
    result = run_cli("prepare", str(path), "--workers", "1", env={"LMLAB_CACHE": str(root)})
    assert not marker.exists()
    assert result.returncode == 0, result.stderr
    assert f"{partial} cannot be resumed" in result.stderr and "starting it over" in result.stderr
    assert files_of(root / "tokens" / partial.name) == files_of(reference)
    assert not partial.exists()


def damage_state(partial: Path) -> str:
    (partial / "state.json").write_text('{"format": 3, "key": ')
    return "state.json does not parse"


def damage_checkpoint(partial: Path) -> str:
    name = json.loads((partial / "state.json").read_text())["checkpoint"]["file"]
    data = bytearray((partial / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (partial / name).write_bytes(bytes(data))
    return f"{name} does not match its recorded SHA-256"


def damage_checkpoint_name(partial: Path) -> str:
    state = json.loads((partial / "state.json").read_text())
    state["checkpoint"]["file"] = "../../outside.npz"
    (partial / "state.json").write_text(json.dumps(state))
    return "bad checkpoint"


@pytest.mark.parametrize("damage", [damage_state, damage_checkpoint, damage_checkpoint_name])
def test_a_damaged_partial_build_starts_over_with_a_warning(tmp_path, capsys, damage):
    variant = variant_of(write_manifest(tmp_path))
    reference = pipeline.prepare_corpus(variant, root=tmp_path / "reference", workers=1, listener=quiet)
    partial = interrupted(variant, tmp_path / "cache")
    what = damage(partial)
    capsys.readouterr()
    resumed = pipeline.prepare_corpus(variant, root=tmp_path / "cache", workers=1, listener=quiet)
    err = capsys.readouterr().err
    assert f"lmlab: warning: the interrupted preparation in {partial} cannot be resumed" in err and what in err
    assert files_of(resumed) == files_of(reference)


# -- damaged entries --------------------------------------------------------------------------------

def truncate_shard(folder: Path) -> str:
    path = folder / "train-00000.bin"
    path.write_bytes(path.read_bytes()[:-10])
    return "train-00000.bin holds"


def alter_tokenizer(folder: Path) -> str:
    (path,) = (p for p in (folder / "tokenizer").rglob("*") if p.is_file())
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit: same size, another vocabulary
    path.write_bytes(bytes(data))
    return f"tokenizer/{path.relative_to(folder / 'tokenizer').as_posix()} does not match its SHA-256"


def add_tokenizer_file(folder: Path) -> str:
    (folder / "tokenizer" / "extra.json").write_text("{}")
    return "tokenizer/extra.json is not one of the fitted tokenizer's files"


def garble_index(folder: Path) -> str:
    (folder / "index.json").write_text("garbage")
    return "index.json does not parse"


def remove_shard(folder: Path) -> str:
    (folder / "val-00000.docs").unlink()
    return "val-00000.docs is missing"


@pytest.mark.parametrize("damage", [truncate_shard, alter_tokenizer, add_tokenizer_file, garble_index, remove_shard])
@pytest.mark.parametrize("how", ["prepare", "open"])
def test_a_damaged_entry_is_rebuilt_with_a_warning_to_the_same_tokens(tmp_path, capsys, damage, how):
    variant = variant_of(write_manifest(tmp_path))
    root = tmp_path / "cache"
    first = token_cache.load_tokens(variant, root=root, workers=1)
    folder, original = first.directory, files_of(first.directory)
    train = np.asarray(first.train).copy()
    what = damage(folder)
    capsys.readouterr()
    if how == "prepare":
        again = token_cache.load_tokens(variant, root=root, workers=1)
    else:  # the folder's opener checks too
        again = token_cache.open_prepared(variant, folder)
    err = capsys.readouterr().err
    assert f"lmlab: warning: the token cache entry {folder} is damaged" in err and what in err
    assert again.directory == folder and files_of(folder) == original
    np.testing.assert_array_equal(np.asarray(again.train), train)
    assert again.tokenizer.decode(train[:20].tolist()) == first.tokenizer.decode(train[:20].tolist())


def test_a_verified_entry_is_used_as_it_is_and_hashed_once_per_process(tmp_path, monkeypatch):
    variant = variant_of(write_manifest(tmp_path))
    root = tmp_path / "cache"
    folder = pipeline.prepare_corpus(variant, root=root, workers=1, listener=quiet)
    entry._verified.clear()  # as a new process finds it
    hashed = []
    sha256_file = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda path: hashed.append(path) or sha256_file(path))
    for _ in range(3):
        token_cache.load_tokens(variant, root=root, workers=1)
    index = json.loads((folder / "index.json").read_text())
    n_files = sum(len(s["files"]) for split in index["shards"].values() for s in split) + len(index["tokenizer"])
    assert len(hashed) == n_files and len(set(hashed)) == n_files and index["tokenizer"]


def test_lmlab_prepare_rebuilds_a_truncated_shard_of_the_cache(tmp_path):
    path = write_manifest(tmp_path)
    env = {"LMLAB_CACHE": str(tmp_path / "cache")}
    assert run_cli("prepare", str(path), "--workers", "1", env=env).returncode == 0
    (folder,) = (tmp_path / "cache" / "tokens").iterdir()
    original = files_of(folder)
    truncate_shard(folder)
    result = run_cli("prepare", str(path), "--workers", "1", env=env)
    assert result.returncode == 0, result.stderr
    assert f"lmlab: warning: the token cache entry {folder} is damaged (train-00000.bin holds" in result.stderr
    assert "(already prepared)" not in result.stdout and files_of(folder) == original


# -- the cache folder itself ------------------------------------------------------------------------

def unwritable_home(tmp_path: Path) -> dict:
    """An environment whose HOME lies under a regular file: no folder can be made there, not even by root."""
    (tmp_path / "afile").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "LMLAB_CACHE"}
    return {**env, "HOME": str(tmp_path / "afile" / "home"), "OMP_NUM_THREADS": "1",
            "MPLCONFIGDIR": str(tmp_path / "mpl")}


@pytest.mark.parametrize("verb", ["prepare", "run"])
def test_an_unwritable_cache_folder_is_one_line_naming_it_and_lmlab_cache(tmp_path, verb):
    path = write_manifest(tmp_path, filters="[]")
    if verb == "run":
        path.write_text(path.read_text() + "[model]\nn_layers = 1\nd_model = 16\nn_heads = 2\nblock_size = 8\n"
                                           "[train]\nmax_steps = 1\nbatch_size = 2\n")
    command = [sys.executable, "-m", "lmlab", verb, str(path)]
    if verb == "run":
        command += ["--out", str(tmp_path / "runs")]
    result = subprocess.run(command, env=unwritable_home(tmp_path), capture_output=True, text=True, timeout=300)
    folder = tmp_path / "afile" / "home" / ".cache" / "lmlab"
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("lmlab: ")]
    assert lines == [f"lmlab: error: cannot write the token cache in {folder} (Not a directory); choose another "
                     "folder with the LMLAB_CACHE environment variable"]
    assert "Traceback" not in result.stderr
    if verb == "prepare":
        assert result.stderr.count("\n") == 1


def test_temporary_names_differ_between_writers_of_the_same_file(tmp_path):
    target = tmp_path / "state.json"
    names = {shards.temporary(target) for _ in range(100)}
    assert len(names) == 100 and all(str(os.getpid()) in n.name and n.parent == tmp_path for n in names)
    shards.write_bytes(target, b"{}")
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
