"""Config loading, overrides and validation errors that name the field."""

import pytest

from vespo.config import Config, ConfigError, field_schemas, load_config, to_dict
from vespo.losses import get_loss


def test_defaults_validate_and_demo_loads():
    from vespo.trainer.cli import default_config_path

    cfg = load_config(default_config_path())
    assert cfg.loss.name == "vespo" and cfg.staleness.n == 8
    assert cfg.prompts_per_minibatch * cfg.staleness.n == cfg.prompts_per_step


def test_overrides_parse_values_by_type(tmp_path):
    cfg = load_config(None, ["loss.name=gspo", "staleness.n=4", "optim.lr=2e-4", "loss.options.agg=token-mean",
                             "async.workers=2", "model.path=null"])
    assert cfg.loss.name == "gspo" and cfg.staleness.n == 4
    assert cfg.optim.lr == pytest.approx(2e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.loss.options == get_loss("gspo").config_cls(agg="token-mean")  # built once, typed
    assert cfg.loss.spec is get_loss("gspo") and cfg.loss.options is cfg.loss.options  # looked up and built once
    assert to_dict(cfg)["loss"]["options"] == {"agg": "token-mean"}  # recorded as written
    assert cfg.async_.workers == 2 and cfg.model.path is None


def test_loss_options_are_recorded_as_written_and_read_back_to_the_same_config():
    """A nested option (rollout_correction) is the loss's typed config in memory, the mapping as written on disk, and
    the written mapping builds the same config again."""
    from vespo.config import from_dict

    cfg = load_config(None, ["loss.name=reinforce", "loss.options={is_level: none, rollout_correction: {mode: "
                             "tis_token, threshold: 3.0}}"])
    assert cfg.loss.options.rollout_correction == type(cfg.loss.options.rollout_correction)(mode="tis_token",
                                                                                           threshold=3.0)
    written = {"is_level": "none", "rollout_correction": {"mode": "tis_token", "threshold": 3.0}}
    assert to_dict(cfg)["loss"]["options"] == written
    again = from_dict(to_dict(cfg))
    assert again.loss.options == cfg.loss.options and to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize("override, words", [
    ("staleness.n=0", ["staleness.n", ">= 1", "0"]),
    ("staleness.n=3", ["staleness.n=3", "prompts_per_step=32"]),
    ("rollout.top_p=1.5", ["rollout.top_p", "<= 1.0"]),
    ("staleness.behavior=foo", ["staleness.behavior", "recompute", "rollout"]),
    ("optim.lr=abc", ["optim.lr", "float"]),
    ("loss.name=vespoo", ["loss.name", "vespoo", "grpo"]),
    ("loss.options.k_pos=-1", ["k_pos"]),
    ("loss.options.nonsense=1", ["nonsense", "valid options"]),
    ("staleness.m=3", ["staleness.m", "behavior"]),
    ("run=3", ["run is a section"]),
    ("noequals", ["section.field=value"]),
])
def test_invalid_values_name_the_field(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_yaml_unknown_key_and_bad_section(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lrr: 1.0\n")
    with pytest.raises(ConfigError, match=r"lrr.*optim"):
        load_config(p)
    p.write_text("optim: 3\n")
    with pytest.raises(ConfigError, match="optim must be a mapping"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_every_field_is_documented_and_round_trips():
    fields = {f"{section}.{name}": f for section in field_schemas() for name, f in field_schemas(section).items()}
    assert len(fields) > 40
    undocumented = [name for name, f in fields.items() if not f.get("description", "").strip()]
    assert undocumented == []  # every field's help text for `vespo train --help-config`
    from vespo.config import from_dict

    cfg = Config()
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)


@pytest.mark.parametrize("n", [1, 4, 32, 64])
def test_paper_protocol_fixes_the_minibatch_and_the_optimizer_steps(n):
    """staleness.minibatch_prompts and run.updates: N varies alone (rollout batch = N x mini-batch)."""
    cfg = load_config(None, [f"staleness.n={n}", "staleness.minibatch_prompts=8", "run.updates=512"])
    assert cfg.prompts_per_minibatch == 8
    assert cfg.prompts_per_step == 8 * n
    assert cfg.steps * n == 512  # equal optimizer steps (and samples) at every N
    assert (cfg.rollout.prompts_per_step, cfg.run.steps) == (32, 40)  # derived, never written back by validation
    from vespo.config import from_dict

    again = from_dict(to_dict(cfg))  # a saved config resolves to itself
    assert to_dict(again) == to_dict(cfg)


def test_paper_protocol_rejects_updates_that_n_does_not_divide():
    with pytest.raises(ConfigError, match=r"staleness.n=3 must divide run.updates=64"):
        load_config(None, ["staleness.n=3", "staleness.minibatch_prompts=2", "run.updates=64"])


def test_load_yaml_names_the_file_and_line(tmp_path):
    from vespo.config import load_yaml

    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not valid YAML .*line 3"):
        load_yaml(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml: the top level must be a mapping, got list"):
        load_yaml(p)
    p.write_text("")
    assert load_yaml(p) == {}
    with pytest.raises(KeyError, match="sweep file not found"):
        load_yaml(tmp_path / "missing.yaml", what="sweep", error=KeyError)
