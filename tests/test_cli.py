"""psd.flags.FLAGS: one declaration per flag, its environment variable, the README generated from it."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import ROOT
from psd.cli import _watchdog_config, get_args_parser
from psd.flags import BEGIN, END, FLAGS, readme_table, serve_fields
from psd.server import ServeConfig


def test_the_readme_flag_table_is_the_generated_one():
    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text
    current = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert current == readme_table(), "the README's flag table is stale: run `python -m psd.flags README.md`"


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
