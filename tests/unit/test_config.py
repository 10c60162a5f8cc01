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


def test_a_params_file_extends_another(tmp_path):
    """``extends: FILE`` (relative to the file's folder): the file's keys over the base's, nested mappings
    merged key by key, lists replaced; chains resolve; a cycle, a missing base or a bad value is one line
    naming the file and the field."""
    (tmp_path / "base.yaml").write_text("run_name: base\nn_questions: 7\nformulations: [reference, paraphrase_a]\n"
                                        "backend_options: {batch_size: 4, token_budget: 999}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mid.yaml").write_text("extends: ../base.yaml\nrun_name: mid\nformulations: [reference]\n"
                                               "backend_options: {batch_size: 2}\n")
    (tmp_path / "sub" / "top.yaml").write_text("extends: mid.yaml\nn_questions: 3\n")
    p = load_params(tmp_path / "sub" / "top.yaml")
    assert (p["run_name"], p["n_questions"], p["formulations"]) == ("mid", 3, ["reference"])
    assert p["backend_options"] == {"batch_size": 2, "token_budget": 999} and "extends" not in p
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match=r"field 'extends' makes a cycle \(.*a.yaml -> .*b.yaml -> .*a.yaml\)"):
        load_params(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"c.yaml: field 'extends': .*nowhere.yaml does not exist"):
        load_params(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("extends: [a.yaml, b.yaml]\n")
    with pytest.raises(ConfigError, match=r"d.yaml: field 'extends' must name one parameter file"):
        load_params(tmp_path / "d.yaml")
    (tmp_path / "e.yaml").write_text("extends: base.yaml\nn_questions: many\n")
    with pytest.raises(ConfigError, match="n_questions"):
        load_params(tmp_path / "e.yaml")
