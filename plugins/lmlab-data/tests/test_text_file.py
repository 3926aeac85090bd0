import gzip
import os
import sysconfig
from pathlib import Path

import pytest

from lmlab.api import UserError
from lmlab.testing import check_plugin_class
from lmlab_data.text_file import TextFile

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def source(**options):
    return TextFile(TextFile.Options(**options))


def test_meets_the_plugin_contract(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    check_plugin_class(TextFile, "data", {"path": str(tmp_path / "a.txt")})


def test_documents_is_the_whole_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("First Citizen:\nBefore we proceed\n", encoding="utf-8")
    assert list(source(path=path).documents()) == ["First Citizen:\nBefore we proceed\n"]


def test_line_endings_are_kept_as_written(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"a\r\nb\r\n")
    assert list(source(path=path).documents()) == ["a\r\nb\r\n"]


def test_missing_file_fails_validation_naming_the_key(tmp_path):
    with pytest.raises(ValueError) as err:
        TextFile.Options(path=str(tmp_path / "nope.txt"))
    assert err.value.errors()[0]["loc"] == ("path",)


def test_a_pattern_that_matches_nothing_fails_validation(tmp_path):
    with pytest.raises(ValueError, match="no file matches"):
        TextFile.Options(path=str(tmp_path / "*.md"))


def test_a_folder_is_refused_with_a_pattern_to_use_instead(tmp_path):
    with pytest.raises(ValueError, match=r"is a folder; .*\*\*"):
        TextFile.Options(path=str(tmp_path))


def test_relative_path_resolves_against_the_manifest_folder(tmp_path):
    (tmp_path / "corpus.txt").write_text("abc", encoding="utf-8")
    options = TextFile.Options.model_validate({"path": "corpus.txt"}, context={"base_dir": tmp_path})
    assert options.files() == [tmp_path / "corpus.txt"]


def test_patterns_give_one_document_per_file_in_sorted_order_each_once(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.txt", "skip.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    docs = list(source(path=[str(tmp_path / "**" / "*.txt"), str(tmp_path / "a.txt")]).documents())
    assert docs == ["a.txt", "b.txt", "sub/c.txt"]


def test_exclude_leaves_files_out_by_full_path(tmp_path):
    for name in ("keep/a.txt", "test/b.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    assert list(source(path=str(tmp_path / "**" / "*.txt"), exclude=["*/test/*"]).documents()) == ["keep/a.txt"]


def test_separator_splits_each_file_into_documents_dropping_blank_pieces(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("one<|endoftext|>two\n<|endoftext|> \n<|endoftext|>three")
    assert list(source(path=path, separator="<|endoftext|>").documents()) == ["one", "two\n", "three"]


def test_separator_cut_by_the_read_chunks_still_splits(tmp_path, monkeypatch):
    monkeypatch.setattr("lmlab_data.text_file.CHUNK", 3)
    path = tmp_path / "docs.txt"
    path.write_text("alpha@@beta@@gamma")
    assert list(source(path=path, separator="@@").documents()) == ["alpha", "beta", "gamma"]


def test_empty_files_are_no_documents(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("b")
    assert list(source(path=str(tmp_path / "*.txt")).documents()) == ["b"]


def test_gzip_files_are_read_decompressed(tmp_path):
    path = tmp_path / "a.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("zipped")
    assert list(source(path=path).documents()) == ["zipped"]


def test_fingerprint_changes_when_the_content_changes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("to be", encoding="utf-8")
    before = source(path=path).fingerprint()
    assert source(path=path).fingerprint() == before
    path.write_text("or not", encoding="utf-8")
    assert source(path=path).fingerprint() != before


def test_fingerprint_changes_when_a_file_joins_the_pattern(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    before = source(path=str(tmp_path / "*.txt")).fingerprint()
    (tmp_path / "b.txt").write_text("b")
    assert source(path=str(tmp_path / "*.txt")).fingerprint() != before


def test_fingerprint_changes_with_the_options(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("to be", encoding="utf-8")
    assert source(path=path).fingerprint() != source(path=path, val_fraction=0.2).fingerprint()


def test_file_in_another_encoding_is_a_user_error_naming_it(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt is not valid utf-8"):
        list(source(path=path).documents())
    assert list(source(path=path, encoding="latin-1").documents()) == ["café"]


def test_an_unknown_encoding_is_refused_by_the_options(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(ValueError, match="unknown encoding"):
        TextFile.Options(path=str(tmp_path / "a.txt"), encoding="utf-9")


def test_bad_file_skip_leaves_unreadable_files_out_and_counts_them(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(b"\xff\xfe bad")
    (tmp_path / "b.txt").write_text("good")
    plugin = source(path=str(tmp_path / "*.txt"), bad_file="skip")
    assert list(plugin.documents()) == ["good"]
    assert plugin.stats() == {"files_skipped": 1}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_a_file_without_read_permission_is_a_user_error_naming_it(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("x")
    path.chmod(0)
    with pytest.raises(UserError, match=r"secret\.txt cannot be read"):
        source(path=path).fingerprint()


def test_a_read_failure_is_a_user_error_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text("x")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("lmlab_data.text_file.open_text", refuse)
    with pytest.raises(UserError, match=r"a\.txt cannot be read \(Permission denied\)") as err:
        list(source(path=path).documents())
    assert str(err.value).startswith("data.path: ")


@pytest.mark.skipif(not (STDLIB / "encodings").is_dir(), reason="no standard library sources here")
def test_reads_the_standard_librarys_encodings_package():
    docs = list(source(path=str(STDLIB / "encodings" / "*.py")).documents())
    assert len(docs) > 50 and any("Codec" in d for d in docs)


def test_patterns_match_what_glob_matches(tmp_path):
    import glob

    from lmlab_data.files import expand

    for name in ("a.py", "b.txt", ".hidden.py", "x/c.py", "x/y/d.py", "x/.h/e.py", ".git/f.py", "z/test/g.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    for pattern in ("**/*.py", "*.py", "x/*/*.py", "**/test/*.py", "x/**", ".*.py", "*/y/d.py"):
        full = str(tmp_path / pattern)
        expected = sorted(p for p in glob.glob(full, recursive=True) if Path(p).is_file())
        assert sorted(set(expand(full))) == expected, pattern


def test_excluded_folders_are_not_even_walked(tmp_path, monkeypatch):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "a.txt").write_text("a")
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "b.txt").write_text("b")
    plugin = source(path=str(tmp_path / "**" / "*.txt"), exclude=["*/vendor/*"])
    walked = []
    real_scandir = os.scandir
    monkeypatch.setattr("lmlab_data.files.os.scandir", lambda d: walked.append(Path(d).name) or real_scandir(d))
    assert list(plugin.documents()) == ["a"] and walked and "vendor" not in walked
