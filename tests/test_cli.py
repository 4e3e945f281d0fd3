"""psd.flags.FLAGS: one declaration per flag, its environment variable, the README generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from conftest import ROOT, child_env
from psd.cli import _watchdog_config, get_args_parser
from psd.flags import BEGIN, END, FLAGS, NODES, readme_table, serve_fields
from psd.server import ServeConfig


def test_the_readme_flag_table_is_the_generated_one():
    text = (ROOT / "docs" / "reference.md").read_text()
    assert BEGIN in text and END in text
    current = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert current == readme_table(), ("the flag table of docs/reference.md is stale: run "
                                       "`python -m psd.flags docs/reference.md`")


def test_every_serve_config_field_has_one_flag():
    fields = {f.name for f in dataclasses.fields(ServeConfig)} - {"poll_interval"}
    declared = [f.field for f in serve_fields()]
    assert sorted(declared) == sorted(fields)


def test_no_flag_is_declared_twice_for_one_command():
    seen = set()
    for f in FLAGS:
        for c in f.commands:
            assert (c, f.name) not in seen, f"{f.name} declared twice for psd {c}"
            seen.add((c, f.name))


@pytest.mark.parametrize("env, argv, expect", [
    ({"PSD_BETAS": "0.8 0.95"}, ["serve"], ("betas", [0.8, 0.95])),
    ({"PSD_BETAS": "0.8,0.95"}, ["run"], ("betas", [0.8, 0.95])),
    ({"PSD_NO_WATCHDOG": "1"}, ["serve"], ("no_watchdog", True)),
    ({"PSD_QUIET": "yes"}, ["run"], ("quiet", True)),
    ({"PSD_RING_DEPTH": "8"}, ["serve"], ("ring_depth", 8)),
    ({"PSD_ASYNC_MOMENTUM": "off"}, ["serve"], ("async_momentum", "off")),
    ({"PSD_JSON": "1"}, ["status"], ("json", True)),
    ({"PSD_SAMPLE": "0"}, ["status"], ("sample", 0.0)),
    ({"PSD_BENCH_LEARNERS": "1 2"}, ["bench"], ("learners", [1, 2])),
    ({"PSD_LEARNERS": "3"}, ["bench"], ("learners", None)),  # a job's learners do not set bench's list
    ({"PSD_LR": "0.5"}, ["serve", "--lr", "0.25"], ("lr", 0.25)),  # the command line wins
])
def test_every_flag_can_come_from_the_environment(monkeypatch, env, argv, expect):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = get_args_parser().parse_args(argv)
    assert getattr(args, expect[0]) == expect[1]


def test_a_bad_environment_value_says_which_variable(monkeypatch):
    monkeypatch.setenv("PSD_LEARNERS", "many")
    with pytest.raises(SystemExit, match="PSD_LEARNERS='many' is not a valid int"):
        get_args_parser()


def test_argv_gives_back_the_same_config_for_defaults_and_switches():
    for flags in (["serve"], ["serve", "--staleness-lr", "--optimizer", "momentum", "--predict",
                              "--ring-depth", "16", "--async-momentum", "off"]):
        first = _watchdog_config(get_args_parser().parse_args(flags)).serve
        again = _watchdog_config(get_args_parser().parse_args(["serve", *first.argv()])).serve
        assert again == first


def test_the_deprecated_slots_flag_fills_ring_depth_and_names_it(capsys):
    args = get_args_parser().parse_args(["doctor", "--slots", "16"])
    assert args.ring_depth == 16 and "--ring-depth" in capsys.readouterr().err


# psd chaos signals processes: what it kills comes from its command line alone (docs/reference.md, "Commands").
COMMAND_LINE_ONLY = {"chaos"}
ENV_PREFIX = {"bench": "PSD_BENCH_"}
# What a command needs on its command line besides the flag under test, by the dests that stand in for it.
NEEDS = {"export": {("out",): ["--out", "m.pt"], ("job", "checkpoint"): ["--job", "j"]},
         "chaos": {("job",): ["--job", "j"]}}


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in get_args_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every flag a user can give (not -h, not a hidden deprecated alias, not a positional)."""
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


def _sample(a: argparse.Action) -> tuple[str, object]:
    """A PSD_<FLAG> value for ``a`` and what it must parse to (never the flag's default)."""
    if isinstance(a, argparse._StoreTrueAction):
        return "1", True
    if a.choices:
        defaults = list(a.default) if isinstance(a.default, tuple | list) else [a.default]
        one = next(c for c in a.choices if c not in defaults)
        return one, [one] if a.nargs == "+" else one
    one, raw = {int: (7, "7"), float: (0.375, "0.375")}.get(a.type, ("x", "x"))
    if a.nargs in (2, "+"):
        return f"{raw} {raw}", [one, one]
    return raw, one


def _argv(command: str, dest: str) -> list[str]:
    return [command, *(x for dests, flags in NEEDS.get(command, {}).items() if dest not in dests for x in flags)]


def test_every_flag_of_every_command_takes_its_default_from_psd_flag(monkeypatch):
    """The rule, walked over every parser: PSD_<FLAG> (psd bench: PSD_BENCH_<FLAG>) sets each flag's default,
    and its help names the variable; psd chaos alone ignores the environment."""
    for k in [k for k in os.environ if k.startswith("PSD_")]:
        monkeypatch.delenv(k)
    checked = 0
    for command, parser in _commands().items():
        for a in _options(parser):
            env = ENV_PREFIX.get(command, "PSD_") + a.dest.upper()
            if command in COMMAND_LINE_ONLY and a.required:
                continue  # test_chaos_needs_its_job_on_the_command_line
            raw, want = _sample(a)
            monkeypatch.setenv(env, raw)
            got = getattr(get_args_parser().parse_args(_argv(command, a.dest)), a.dest)
            monkeypatch.delenv(env)
            if command in COMMAND_LINE_ONLY:
                assert got == a.default, f"psd {command} {a.option_strings[-1]} took {env} from the environment"
                assert env not in (a.help or "")
            else:
                assert got == want, f"psd {command} {a.option_strings[-1]}: {env}={raw!r} gave {got!r}"
                assert f"[{env}]" in a.help, f"psd {command} --help does not name {env}"
            checked += 1
    assert checked > 100


def test_export_takes_its_source_from_the_environment_and_the_command_line_wins(monkeypatch):
    from psd.cli import _export_source

    for k in [k for k in os.environ if k.startswith("PSD_")]:
        monkeypatch.delenv(k)
    with pytest.raises(SystemExit):  # neither source: argparse says which flags are missing
        get_args_parser().parse_args(["export", "--out", "m.pt"])
    monkeypatch.setenv("PSD_JOB", "envjob")  # psd run sets it for every learner
    monkeypatch.setenv("PSD_OUT", "env.pt")
    args = get_args_parser().parse_args(["export", "--checkpoint", "c.safetensors"])
    _export_source(args)
    assert (args.job, args.checkpoint, args.out) == (None, "c.safetensors", "env.pt")
    monkeypatch.setenv("PSD_CHECKPOINT", "env.safetensors")
    args = get_args_parser().parse_args(["export", "--job", "j"])
    _export_source(args)
    assert (args.job, args.checkpoint) == ("j", None)
    args = get_args_parser().parse_args(["export"])
    with pytest.raises(SystemExit, match=r"PSD_JOB .* and PSD_CHECKPOINT .* are both set"):
        _export_source(args)


def test_chaos_needs_its_job_on_the_command_line(monkeypatch):
    monkeypatch.setenv("PSD_JOB", "some-job")
    with pytest.raises(SystemExit):
        get_args_parser().parse_args(["chaos"])


def test_every_flags_default_keeps_its_own_rule_and_the_config_checks_each_rule():
    ruled = [f for f in FLAGS if f.valid is not None or f.choices is not None]
    assert len(ruled) > 30
    for f in ruled:
        f.check(f.default() if callable(f.default) else f.default)
    ServeConfig().validate()  # the defaults, together
    # ServeConfig.validate asks each serve flag's rule: a bad value in any field is refused, naming its flag.
    for f in serve_fields():
        if f.valid is None or f.nargs == 2:
            continue
        bad = -1 if f.type in (int, float) else None
        if bad is None or f.valid(bad):
            continue
        several = {"nnodes": 2} if f.group == NODES and f.field != "nnodes" else {}  # checked for several nodes
        with pytest.raises(ValueError, match=f"^{f.name} must be "):
            dataclasses.replace(ServeConfig(), **{f.field: f.type(bad)}, **several).validate()
    # A one-node job does not check the several-node settings (--nnodes 1 starts nothing of them).
    ServeConfig(master_port=0, sync_every=0).validate()


@pytest.mark.parametrize("argv, said", [
    (["serve", "--keep", "0"], "psd serve: --keep must be 1 or more, not 0"),
    (["serve", "--betas", "0.9", "1"], "psd serve: --betas must be two numbers in [0, 1), not 0.9 1.0"),
    (["serve", "--metrics-port", "70000"], "psd serve: --metrics-port must be 0..65535, not 70000"),
    (["serve", "--nnodes", "2", "--node-timeout", "0"], "--node-timeout must be a positive number of seconds"),
    (["run", "--stages", "0", "--", "python", "x.py"], "psd run: --stages must be 1 or more, not 0"),
])
def test_a_value_that_breaks_its_flags_rule_is_refused_naming_the_rule(argv, said):
    import subprocess
    import sys

    from conftest import child_env

    command, *rest = argv  # the job's name before any `--` (after it, it would be the learner command's)
    r = subprocess.run([sys.executable, "-m", "psd.cli", command, "--job", "rules", *rest], capture_output=True,
                       text=True, env=child_env(), timeout=60)
    assert r.returncode != 0 and said in r.stderr, r.stderr


def test_every_command_checks_its_flags_rules_and_takes_its_defaults_and_lists():
    """Every command checks its flags' rules (only psd serve and psd run did: psd checkpoint --keep 0 deleted the
    job's other checkpoints), and what each takes by default, or as a list of choices, passes."""
    from psd.flags import check_args

    parser = get_args_parser()
    for argv in (["serve"], ["run", "--", "x"], ["status"], ["top"], ["stop"], ["checkpoint"], ["inspect"],
                 ["export", "--out", "m.pt", "--job", "j"], ["clean"], ["doctor"], ["chaos", "--job", "j"],
                 ["bench", "--pull-modes", "copy", "view", "--grad-dtypes", "float32", "bf16", "--overlap-modes",
                  "on", "off", "--sizes", "10", "20"]):
        args = parser.parse_args(argv)
        check_args(args, args.command)
    r = subprocess.run([sys.executable, "-m", "psd.cli", "checkpoint", "--job", "nothing-here", "--keep", "0"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 2 and "--keep must be 1 or more, not 0" in r.stderr, r.stderr
