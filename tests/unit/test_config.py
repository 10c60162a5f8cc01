import pytest

from memtoc import cli
from memtoc.config.params import DEFAULTS, load_params, resolve_release_dir, validate_params
from memtoc.core.errors import ConfigError, DataError


def test_defaults_validate():
    p = validate_params({})
    assert p["models"] == DEFAULTS["models"]
    assert p["formulations"] == ["reference", "paraphrase_a", "paraphrase_b"]


def test_unknown_parameter_names_the_file_and_lists_valid(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("run_name: x\nn_question: 5\n")
    with pytest.raises(ConfigError) as e:
        load_params(f)
    msg = str(e.value)
    assert str(f) in msg and "n_question" in msg and "n_questions" in msg


def test_bad_field_is_named():
    with pytest.raises(ConfigError, match="n_questions"):
        validate_params({"n_questions": -3})
    with pytest.raises(ConfigError, match="paraphrase_a"):
        validate_params({"formulations": ["reference", "paraphrase_c"]})
    with pytest.raises(ConfigError, match="transformers"):
        validate_params({"backend": "tgi"})


def test_missing_params_file_lists_shipped_ones(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_params(tmp_path / "nope.yaml")


def test_nested_finetune_block_merges():
    p = validate_params({"finetune": {"max_steps": 3}})
    assert p["finetune"]["enabled"] is True and p["finetune"]["max_steps"] == 3


def test_missing_release_dir_explains(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTOC_RELEASE", str(tmp_path / "absent"))
    with pytest.raises(DataError) as e:
        resolve_release_dir()
    assert "MEMTOC_RELEASE" in str(e.value) and "absent" in str(e.value)


def test_release_dir_found():
    assert (resolve_release_dir() / "questions_575.jsonl").is_file()


def test_cli_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
