import pytest

from lmlab.api import UserError
from lmlab_data.text_file import TextFile


def source(**options):
    return TextFile(TextFile.Options(**options))


def test_documents_is_the_whole_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("First Citizen:\nBefore we proceed\n", encoding="utf-8")
    assert list(source(path=path).documents()) == ["First Citizen:\nBefore we proceed\n"]


def test_missing_file_fails_validation_naming_the_key(tmp_path):
    with pytest.raises(ValueError) as err:
        TextFile.Options(path=tmp_path / "nope.txt")
    assert err.value.errors()[0]["loc"] == ("path",)


def test_relative_path_resolves_against_the_manifest_folder(tmp_path):
    (tmp_path / "corpus.txt").write_text("abc", encoding="utf-8")
    options = TextFile.Options.model_validate({"path": "corpus.txt"}, context={"base_dir": tmp_path})
    assert options.path == tmp_path / "corpus.txt"


def test_fingerprint_changes_when_the_content_changes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("to be", encoding="utf-8")
    before = source(path=path).fingerprint()
    assert source(path=path).fingerprint() == before
    path.write_text("or not", encoding="utf-8")
    assert source(path=path).fingerprint() != before


def test_fingerprint_changes_with_the_options(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("to be", encoding="utf-8")
    assert source(path=path).fingerprint() != source(path=path, val_fraction=0.2).fingerprint()


def test_file_in_another_encoding_is_a_user_error(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match="utf-8"):
        list(source(path=path).documents())
    assert list(source(path=path, encoding="latin-1").documents()) == ["café"]
