"""One source for every setting: each flag is defined once, from the config dataclasses,
and `pdserve serve` hands its children every setting they share with it."""

import argparse
import dataclasses
import importlib
import json
import os
import stat

import pytest

from pdserve import flags
from pdserve.cli import SUBCOMMANDS, main
from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, KVTierConfig, LoRAConfig, SchedulerConfig
from pdserve.planner.cli import PLAN_SECTIONS
from pdserve.settings import COMMANDS
from pdserve.sim.cli import SIM_SECTIONS

ENGINE_PARTS = (EngineConfig, DeviceConfig, CacheConfig, SchedulerConfig, KVTierConfig, LoRAConfig)

# Flags of the same name in two commands that are not one definition, and why that is right.
# Anything else that two commands spell alike must be the very same flag.
SAME_NAME = {
    "--api-key": "bench sends the key that serve and router require (vLLM's name on both sides)",
    "--calibrate": "sim: measure the engine and write a profile, then exit; a worker: measure it at start-up",
    "--prefill": "scale takes a new size, also relative (+1); serve a count",
    "--decode": "scale takes a new size, also relative (+1); serve a count",
    "--router": "the router's URL: scale requires it, a worker registers there",
    "--model": "bench: the model id to request (vllm bench serve's --model); plan: the deprecated spelling "
    "of --model-config; everywhere else the weights",
    "--dtype": "convert: the dtype the weights are stored in, float32 by default",
    "--mode": "sim models a third mode (chunked) and spells disaggregated disagg (accepting both)",
    "--seed": "bench and sim: the workload's seed; generate: each prompt's sampling seed (None: random)",
    "--tp": "plan and sim: tensor-parallel GPUs per instance, each command's own help",
    "--json": "print JSON instead of text",
    "--network-gbps": "plan: another name of --link-gbps (several links); sim: the one modelled link",
    "--compute-efficiency": "plan: the roofline's share (1.0: the pure bound); sim: None, the per-GPU figures",
    "--bandwidth-efficiency": "plan: the roofline's share (1.0: the pure bound); sim: None, the per-GPU figures",
}


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"pdserve {command}")
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(p)
    return p


def by_field(p) -> dict[tuple[type, str], flags.Setting]:
    return {(s.cls, s.name): s for s in flags.registered(p).values()}


def default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_every_engine_setting_is_a_flag_of_serve_worker_and_generate_with_one_default():
    cmds = {c: parser(c) for c in ("serve", "worker", "generate")}
    internal = set()
    for cls in ENGINE_PARTS:
        for f in dataclasses.fields(cls):
            if (cls, f.name) not in by_field(cmds["generate"]):
                internal.add(f.name)
                continue
            for c, p in cmds.items():
                assert (cls, f.name) in by_field(p), (c, f.name)
                assert p.get_default(f.name) == default(f), (c, f.name)
    # what is not a flag is set from Python or derived; a new field must be one or the other
    assert internal == {
        "tokenizer",
        "seed",
        "cache",
        "scheduler",
        "device",
        "tiers",
        "lora",
        "dtype_reason",
        "speculative",
        "kv_cache_shm_dir",
    }
    assert flags.registered(cmds["serve"])["scheduling-policy"].name == "policy"  # vLLM's flag name


def test_a_field_without_setting_or_internal_is_refused():
    @dataclasses.dataclass
    class Loose:
        """Loose."""

        x: int = 1

    with pytest.raises(TypeError, match="setting"):
        flags.add_arguments(argparse.ArgumentParser(), [flags.Section(Loose)])


def _own_defaults() -> set[tuple[type, str]]:
    sections = [s for cmd in COMMANDS.values() for s in cmd] + list(SIM_SECTIONS) + list(PLAN_SECTIONS)
    return {(s.cls, name) for s in sections for name in s.defaults}


def _actions(p) -> dict[str, argparse.Action]:
    # argparse has no public list of a parser's options; reading it is enough here
    return {o: a for a in p._actions for o in a.option_strings if o not in ("-h", "--help")}


def _shape(a: argparse.Action):
    def frozen(v):
        return tuple(v) if isinstance(v, list) else v

    return (type(a), a.dest, frozen(a.default), a.help, frozen(a.choices), a.nargs, getattr(a.type, "__name__", a.type))


def test_each_flag_has_one_definition_name_default_and_meaning_across_commands():
    own = _own_defaults()
    settings, plain = {}, {}
    for command in SUBCOMMANDS:
        p = parser(command)
        for flag, s in flags.registered(p).items():
            first_cmd, first = settings.setdefault(flag, (command, s))
            assert (s.cls, s.name, s.meta) == (first.cls, first.name, first.meta), (flag, first_cmd, command)
            if s.default != first.default:
                assert (s.cls, s.name) in own, f"--{flag}: {first_cmd} and {command} differ in its default"
        for option, action in _actions(p).items():
            plain.setdefault(option, []).append((command, _shape(action)))
    for option, uses in plain.items():
        shapes = {shape for _, shape in uses}
        if len(shapes) > 1 and option.lstrip("-") not in settings and option.removeprefix("--no-") not in settings:
            assert option in SAME_NAME, f"{option} means different things in {[c for c, _ in uses]}"
    assert set(SAME_NAME) <= set(plain), "a SAME_NAME entry names no flag any more: drop it"


def test_bf16_is_accepted_everywhere_and_shown_as_bfloat16():
    for command, argv in (
        ("serve", []),
        ("worker", []),
        ("generate", ["--prompt", "x"]),
        ("plan", []),
        ("sim", []),
        ("convert", ["--out", "x"]),
    ):
        assert parser(command).parse_args(["--dtype", "bf16", *argv]).dtype == "bfloat16", command
    assert parser("plan").parse_args(["--kv-dtype", "fp16"]).kv_dtype == "float16"
    assert DeviceConfig(device="cpu", dtype="bf16").dtype == "bfloat16"
    # the help names only the spellings of values the flag takes (fp32 is no modelled KV dtype)
    kv_help = next(x.help for x in parser("plan")._actions if "--kv-dtype" in x.option_strings)
    assert "fp16" in kv_help and "fp32" not in kv_help and "float," not in kv_help


def test_plan_names_the_modelled_model_model_config_and_keeps_model_as_a_deprecated_alias(capsys, caplog):
    argv = ["plan", "--gpu", "h100", "--context", "4096", "--dtype", "bf16", "--json"]
    assert main([*argv, "--model-config", "llama-3-8b"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert new["inputs"]["dtype"] == "bfloat16"
    assert "deprecated" not in caplog.text
    assert main([*argv, "--model", "llama-3-8b"]) == 0
    assert json.loads(capsys.readouterr().out) == new
    assert "--model is deprecated: use --model-config" in caplog.text


def test_sim_model_is_the_weights_and_model_config_the_modelled_model(caplog):
    p = parser("sim")
    assert p.get_default("model") is None and p.get_default("model_config") == "llama-3-70b"
    from pdserve.sim.cli import _model_config

    args = p.parse_args(["--model", "llama-3-8b"])  # the old spelling, without --calibrate
    assert _model_config(args) == "llama-3-8b" and "use --model-config llama-3-8b" in caplog.text
    assert _model_config(p.parse_args(["--model-config", "mistral-7b", "--model", "/weights"])) == "mistral-7b"


def _other(s: flags.Setting):
    """A valid value of the setting that is not its default."""
    if s.is_bool:
        return not s.default
    if s.meta["choices"]:
        return next(c for c in s.meta["choices"] if c not in (s.default, ""))
    if s.type is int:
        return (s.default or 0) + 3
    if s.type is float:
        return (s.default or 0) + 0.25
    if s.type is list:
        return ["a", "b"]
    return f"x-{s.flag}"


def _serve_args_all_changed():
    p = parser("serve")
    args = p.parse_args([])
    for s in flags.registered(p).values():
        setattr(args, s.name, _other(s))
    return args


def _child(command: str, doc: dict, tmp_path):
    path = flags.write_private_json(str(tmp_path / f"{command}.json"), doc)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    return parser(command).parse_args(["--config", path])


def _shared(child: str) -> list[flags.Setting]:
    serve = flags.registered(parser("serve"))
    return [s for flag, s in flags.registered(parser(child)).items() if flag in serve]


def test_serve_hands_the_router_every_setting_they_share(tmp_path):
    from pdserve.server.launcher import _child_env, router_settings

    args = _serve_args_all_changed()
    r = _child("router", router_settings(args, "127.0.0.1", 1234), tmp_path)
    checked = 0
    for s in _shared("router"):
        if s.meta["secret"]:
            continue
        want = {"host": "127.0.0.1", "port": 1234}.get(s.name, getattr(args, s.name))
        assert getattr(r, s.name) == want, f"--{s.flag} did not reach the router"
        checked += 1
    assert checked >= 25  # the router's own settings are nearly all serve's too
    env = _child_env(args)  # the secrets go by the environment, never by file or argv
    assert env["PDSERVE_API_KEY"] == args.api_key and env["PDSERVE_CLUSTER_TOKEN_FILE"].endswith(
        args.cluster_token_file
    )


def test_serve_hands_each_worker_every_setting_they_share(tmp_path):
    from pdserve.server.launcher import worker_settings

    args = _serve_args_all_changed()
    doc = worker_settings(args, "decode", 1, "http://127.0.0.1:9", threads=2, cores=[2, 3])
    w = _child("worker", doc, tmp_path)
    own = {
        "port": 0,
        "internal_aliases": None,  # the deployment's names are its front's (or its router's, on Ray)
        "threads": 2,
        "step_trace": f"{args.step_trace}.decode-1.jsonl",
        "kv_disk_dir": os.path.join(args.kv_disk_dir, "decode-1"),
    }
    checked = 0
    for s in _shared("worker"):
        if s.meta["secret"]:
            continue
        assert getattr(w, s.name) == own.get(s.name, getattr(args, s.name)), f"--{s.flag} did not reach a worker"
        checked += 1
    assert checked >= 35
    assert (w.role, w.worker_id, w.router, w.cpu_cores) == ("decode", "decode-1", "http://127.0.0.1:9", "2,3")


def test_serve_on_ray_hands_each_worker_its_settings_too():
    pytest.importorskip("ray")
    from pdserve.server.ray_launcher import NODE_IP, _worker_settings

    args = _serve_args_all_changed()
    args.host = None  # joined a cluster: each node serves on its own address
    doc = _worker_settings(args, "prefill", 0, "http://10.0.0.1:8000")
    assert doc["host"] == doc["advertise-host"] == NODE_IP
    assert doc["step-trace"] == f"{args.step_trace}.prefill-0.jsonl"  # the Ray launcher used to drop it
    assert doc["max-waiting-requests"] == args.max_waiting_requests and doc["kv-wire"] == args.kv_wire


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"max-num-seqs": 8, "dtype": "bf16", "kv_layerwise": False, "role": "decode"}))
    argv = flags.config_first(["worker", "--max-num-seqs", "5", "--config", str(path)])
    assert argv[:3] == ["worker", "--config", str(path)]
    a = parser("worker").parse_args(argv[1:])
    assert (a.max_num_seqs, a.dtype, a.kv_layerwise, a.role) == (5, "bfloat16", False, "decode")


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"max-num-sequences": 8}, "unknown setting 'max-num-sequences'"),
        ({"max-num-seqs": "8"}, "expected int, got str"),
        ({"kv-layerwise": 1}, "expected bool"),
        ({"dtype": "fp4"}, "'fp4' is not one of"),
        ({"port": None}, "may not be null"),
        ([1, 2], "a JSON object"),
    ],
)
def test_a_bad_config_file_is_refused_with_its_reason(tmp_path, capsys, doc, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        parser("worker").parse_args(["--config", str(path)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_non_defaults_are_what_a_process_logs_at_start_and_hide_secrets():
    p = parser("router")
    args = p.parse_args(["--max-num-seqs-in-flight", "9", "--api-key", "sesame", "--slo-ttft-ms", "500"])
    from pdserve.settings import ROUTER_SECTIONS

    assert flags.non_defaults(ROUTER_SECTIONS, args) == {
        "max-num-seqs-in-flight": 9,
        "api-key": "***",
        "slo-ttft-ms": 500.0,
    }


def test_kv_timeout_has_one_default_whoever_starts_the_router():
    import inspect

    from pdserve.router.disagg import DisaggEngine
    from pdserve.settings import KV_TIMEOUT_S

    assert inspect.signature(DisaggEngine).parameters["kv_timeout_s"].default == KV_TIMEOUT_S
    assert parser("router").get_default("kv_timeout_s") == parser("serve").get_default("kv_timeout_s") == KV_TIMEOUT_S


def test_every_serve_setting_reaches_a_child_or_is_the_launchers_own():
    """A setting added to serve but to neither child would be accepted and then do nothing:
    each serve setting is the router's, a worker's, or one of what serve itself decides."""
    from pdserve.settings import DeploymentConfig, RayConfig

    children = set(flags.registered(parser("router"))) | set(flags.registered(parser("worker")))
    own = {s.flag for section in (DeploymentConfig, RayConfig) for s in flags.settings(flags.Section(section))}
    serve = set(flags.registered(parser("serve")))
    assert serve - children - own == set()
    assert own & children == set(), "a launcher setting that a child also takes would be handed on"


def test_a_bool_decided_later_is_a_flag_pair_whose_default_is_none(tmp_path):
    """`bool | None = None` (decided from other settings when left out): --x and --no-x, and
    null in a config file leaves it undecided."""

    @dataclasses.dataclass
    class Later:
        """Later."""

        fast: bool | None = flags.setting(None, help="faster (default: decided by --dtype)")

    p = argparse.ArgumentParser()
    flags.add_arguments(p, [flags.Section(Later)], config_file=True)
    assert [p.parse_args(a).fast for a in ([], ["--fast"], ["--no-fast"])] == [None, True, False]
    assert "(default: off)" not in p.format_help()
    path = tmp_path / "c.json"
    for value in (None, True):
        path.write_text(json.dumps({"fast": value}))
        assert p.parse_args(["--config", str(path)]).fast is value
    assert flags.build(Later, p.parse_args(["--no-fast"])) == Later(fast=False)


@pytest.mark.parametrize("argv, want", [([], None), (["--int8-activations"], True), (["--no-int8-activations"], False)])
def test_int8_activations_reaches_a_worker_on_off_or_undecided(tmp_path, argv, want):
    """None (decided by --dtype auto in the worker), on and off are three settings: an explicit
    off must not arrive as undecided, which auto may turn on."""
    from pdserve.server.launcher import worker_settings

    args = parser("serve").parse_args(argv)
    args.host = "127.0.0.1"
    doc = worker_settings(args, "prefill", 0, "http://127.0.0.1:9", threads=1)
    assert doc["int8-activations"] is want
    assert _child("worker", doc, tmp_path).int8_activations is want
