"""Config layering: a nested override keeps its siblings' values, for every command.

draccus alone rebuilds a nested config from its class defaults when one of its fields is set on
the command line, so `vla-rl eval --env.task=reach` used to drop eval's 50 worlds back to 16.
"""

import dataclasses

import draccus
import pytest

from vla_rl.cli import COMMANDS, parse_config


def _commands():
    for name, cmd in COMMANDS.items():
        if cmd.subcommands:
            yield from ((f"{name} {sub}", c) for sub, c in cmd.subcommands.items())
        else:
            yield name, cmd


def _changed(value):
    """A value of the same type that differs from ``value``; None where none is obvious."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return value * 2 + 0.5
    if isinstance(value, str):
        return value + "_x"
    return None


def _nested_overrides(cls):
    """(dotted key, new value) for the first overridable leaf of each nested dataclass field of cls()."""
    import typing

    defaults = draccus.encode(cls())
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = defaults.get(f.name)
        if not isinstance(sub, dict) or len(sub) < 2:
            continue
        leaf_hints = typing.get_type_hints(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else {}
        for leaf, value in sub.items():
            choices = (
                typing.get_args(leaf_hints.get(leaf))
                if typing.get_origin(leaf_hints.get(leaf)) is typing.Literal
                else ()
            )
            new = next((c for c in choices if c != value), None) if choices else _changed(value)
            if leaf != "type" and new is not None:
                yield f"{f.name}.{leaf}", new
                break


CASES = [(name, key, new) for name, cmd in _commands() for key, new in _nested_overrides(cmd.config())]


def test_every_command_with_a_nested_config_is_covered():
    assert {name for name, _, _ in CASES} >= {"record", "train", "eval", "quickstart", "sim-robot", "serve"}


@pytest.mark.parametrize("name, key, new", CASES, ids=[f"{n}:{k}" for n, k, _ in CASES])
def test_one_nested_override_keeps_every_sibling(name, key, new):
    config_cls = dict(_commands())[name].config()
    expected = draccus.encode(config_cls())  # the command's own defaults, nested ones included
    parent, leaf = key.split(".")
    expected[parent][leaf] = new
    got = draccus.encode(parse_config(name, [f"--{key}={new}"]))
    assert got[parent] == expected[parent]
    assert got == expected


def test_eval_keeps_its_fifty_worlds_when_the_task_changes():
    cfg = parse_config("eval", ["--env.task=reach"])
    assert (cfg.env.task, cfg.env.num_envs) == ("reach", 50)
    cfg = parse_config("quickstart", ["--eval.env.task=reach"])
    assert (cfg.eval.env.task, cfg.eval.env.num_envs) == ("reach", 50)


def test_switching_a_policy_type_starts_from_that_types_defaults():
    from policies.diffusion_vla import DiffusionVLAConfig

    cfg = parse_config("train", ["--policy.type=diffusion_vla", "--policy.depth=3"])
    assert isinstance(cfg.policy, DiffusionVLAConfig)
    assert cfg.policy.depth == 3
    assert dataclasses.replace(cfg.policy, depth=DiffusionVLAConfig().depth) == DiffusionVLAConfig()


def test_yaml_file_then_command_line_each_over_the_defaults(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text("num_episodes: 7\nenv:\n  image_size: 96\n")
    cfg = parse_config("eval", [f"--config_path={path}", "--env.task=push"])
    assert (cfg.num_episodes, cfg.env.image_size, cfg.env.task, cfg.env.num_envs) == (7, 96, "push", 50)
    cfg = parse_config("eval", [f"--config_path={path}", "--env.image_size=32"])
    assert cfg.env.image_size == 32  # the command line wins over the file


def test_dict_valued_fields_are_replaced_whole_not_merged(tmp_path):
    """A mapping (not a nested config) set by a layer is that layer's mapping exactly."""
    cfg = parse_config("serve", ["--safety.state_bounds={}", "--safety.stale_after_s=0.5"])
    assert cfg.safety.state_bounds == {}  # an empty mapping really is empty: nothing checked
    assert cfg.safety.initial_command == {"grip": 0.0} and cfg.safety.stale_after_s == 0.5
    path = tmp_path / "serve.yaml"
    path.write_text("safety:\n  initial_command:\n    gripper: 1.0\n")
    cfg = parse_config("serve", [f"--config_path={path}"])
    assert cfg.safety.initial_command == {"gripper": 1.0}  # not merged with the default's "grip"
    assert cfg.safety.state_bounds["joint1"] == [-2.8973, 2.8973]  # an unset mapping keeps its default


def test_a_command_line_mapping_replaces_the_yaml_files_whole():
    """The README's serve path: configs/serve.yaml, then the bounds of another robot on the command line."""
    cfg = parse_config("serve", ["--config_path=configs/serve.yaml", "--safety.state_bounds={}"])
    assert cfg.safety.state_bounds == {}
    cfg = parse_config("serve", ["--config_path=configs/serve.yaml", "--safety.state_bounds={j1: [-1, 1]}"])
    assert cfg.safety.state_bounds == {"j1": [-1, 1]}
    assert cfg.safety.max_velocity == [0.5, 0.5, 0.5, 10.0]  # the file's other safety settings stay (default: [])


def test_space_separated_values_switch_a_type_too():
    from policies.diffusion_vla import DiffusionVLAConfig

    cfg = parse_config("train", ["--policy.type", "diffusion_vla", "--policy.depth", "3"])
    assert isinstance(cfg.policy, DiffusionVLAConfig) and cfg.policy.depth == 3


def test_config_path_without_a_file_is_an_error():
    with pytest.raises(SystemExit, match="--config_path needs a YAML file"):
        parse_config("train", ["--config_path", "--steps=3"])


def _literal_fields(cls, prefix=""):
    """(dotted key, allowed values) of every Literal-typed field of cls and of its nested configs."""
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Literal:
            yield prefix + f.name, typing.get_args(hint)
        elif dataclasses.is_dataclass(hint):
            yield from _literal_fields(hint, f"{prefix}{f.name}.")


CHOICES = [(name, key, allowed) for name, cmd in _commands() for key, allowed in _literal_fields(cmd.config())]


def test_choice_fields_are_typed_as_literals():
    keys = {(name, key) for name, key, _ in CHOICES}
    assert {("serve", "chunking.merge"), ("serve", "clock"), ("eval", "chunking.merge"), ("eval", "delay.kind"),
            ("eval", "env.backend"), ("train", "dataset.sampling"), ("record-ros", "compression")} <= keys  # fmt: skip


@pytest.mark.parametrize("name, key, allowed", CHOICES, ids=[f"{n}:{k}" for n, k, _ in CHOICES])
def test_a_value_outside_a_choice_is_rejected_by_the_parser_naming_the_choices(name, key, allowed):
    with pytest.raises(SystemExit) as err:
        parse_config(name, [f"--{key}=not_a_choice"])
    assert "invalid choice: 'not_a_choice'" in str(err.value)
    assert all(repr(a) in str(err.value) for a in allowed)
    value = draccus.encode(parse_config(name, [f"--{key}={allowed[-1]}"]))
    for part in key.split("."):
        value = value[part]
    assert value == allowed[-1]  # a listed choice parses, to itself


def test_eval_and_serve_embed_one_chunking_config_with_their_own_defaults():
    from vla_core.runtime import ChunkingConfig

    evaluation, serving = parse_config("eval", []), parse_config("serve", [])
    assert type(evaluation.chunking) is type(serving.chunking) is ChunkingConfig
    assert evaluation.chunking == ChunkingConfig(execute_steps=0, merge="latest", ensemble_coeff=0.01)
    assert serving.chunking == ChunkingConfig(execute_steps=0, merge="rtc", ensemble_coeff=0.01)
    cfg = parse_config("serve", ["--config_path=configs/serve.yaml", "--chunking.ensemble_coeff=0.5"])
    assert cfg.chunking == ChunkingConfig(execute_steps=8, merge="rtc", ensemble_coeff=0.5)  # the file's, then the flag


@pytest.mark.parametrize(
    "name, flag",
    [("eval", "--n_action_steps=1"), ("eval", "--merge=ensemble"), ("eval", "--ensemble_coeff=0.1"),
     ("serve", "--execute_steps=4"), ("serve", "--merge=latest")],
)  # fmt: skip
def test_the_chunking_flags_of_before_are_rejected_by_name(name, flag):
    with pytest.raises(SystemExit, match=f"unrecognized arguments: {flag}"):
        parse_config(name, [flag])


def test_a_renamed_field_keeps_its_old_name_for_one_release(tmp_path, capsys):
    """`delay.estimate_window` (eval, finetune, train) and serve's `delay_estimate_window` are one field,
    `chunking.estimate_window`: the old names still set it, on the command line and in a YAML file, and
    say so; where the command never read it (train) the old name is dropped with a notice."""
    assert parse_config("eval", ["--delay.estimate_window=7"]).chunking.estimate_window == 7
    assert parse_config("finetune", ["--delay.estimate_window", "6", "--iterations=2"]).chunking.estimate_window == 6
    assert "delay.estimate_window is now chunking.estimate_window" in capsys.readouterr().err
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text("delay_estimate_window: 3\nchunking:\n  merge: latest\n")
    serve = parse_config("serve", [f"--config_path={serve_yaml}"])
    assert (serve.chunking.estimate_window, serve.chunking.merge) == (3, "latest")
    assert "delay_estimate_window is now chunking.estimate_window" in capsys.readouterr().err
    train = parse_config("train", ["--delay.estimate_window", "7", "--steps", "4"])
    assert train.steps == 4 and not hasattr(train.delay, "estimate_window")
    assert "delay.estimate_window had no effect here and is ignored" in capsys.readouterr().err
    # Given under both names, the new one wins.
    assert (
        parse_config("eval", ["--delay.estimate_window=7", "--chunking.estimate_window=2"]).chunking.estimate_window
        == 2
    )
    serve_yaml.write_text("delay_estimate_window: 3\nchunking:\n  estimate_window: 5\n")
    assert parse_config("serve", [f"--config_path={serve_yaml}"]).chunking.estimate_window == 5
    assert "delay_estimate_window is ignored: chunking.estimate_window is given too" in capsys.readouterr().err
    # Under its new name it is a chunking field only: train has none.
    with pytest.raises(SystemExit, match="chunking"):
        parse_config("train", ["--chunking.estimate_window=4"])
