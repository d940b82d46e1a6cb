"""``gpu-serde`` / ``python -m gpu_serde``: help, JSON, a missing extra, and typed argument errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gpu_serde.dask
import gpu_serde.ray


def gpu_serde_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``python -m gpu_serde ARGS``, after ``prelude`` (Python run first in the same process)."""
    code = f"import runpy, sys\n{prelude}\nsys.argv = ['gpu_serde', *{list(args)!r}]\n"
    code += "runpy.run_module('gpu_serde', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["devices", "doctor", "demo", "simulate"])
def test_each_command_has_a_description_and_an_example(command):
    done = subprocess.run(
        [sys.executable, "-m", "gpu_serde", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert "examples:" in done.stdout
    assert f"gpu-serde {command}" in done.stdout.split("examples:")[1]


def test_devices_json_lists_this_process_gpus_by_uuid(sim_env, simulated_gpus):
    env = sim_env([simulated_gpus[2].uuid, simulated_gpus[0].uuid])
    done = subprocess.run(
        [sys.executable, "-m", "gpu_serde", "devices", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(done.stdout)
    assert [(d["ordinal"], d["uuid"]) for d in doc["devices"]] == [
        (0, simulated_gpus[2].uuid),
        (1, simulated_gpus[0].uuid),
    ]
    assert doc["simulated"] is True


@pytest.mark.parametrize("visible", ["0,7,1", "1,1,2", "0,,1"])
def test_devices_says_when_cuda_took_fewer_gpus_than_the_variable_names(sim_env, visible):
    done = subprocess.run(
        [sys.executable, "-m", "gpu_serde", "devices"],
        env=sim_env(visible),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "this process sees 1 GPU(s)" in done.stdout
    assert "note: CUDA_VISIBLE_DEVICES names 3 entries and CUDA took 1" in done.stdout


def test_a_trailing_comma_in_cuda_visible_devices_gets_no_note(sim_env):
    done = subprocess.run(
        [sys.executable, "-m", "gpu_serde", "devices"],
        env=sim_env("0,1,"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "this process sees 2 GPU(s)" in done.stdout and "note:" not in done.stdout


def test_a_uuid_without_its_prefix_is_said_and_the_driver_still_reads_as_simulated(
    sim_env, simulated_gpus
):
    bare = simulated_gpus[1].uuid.removeprefix("GPU-")
    done = subprocess.run(
        [sys.executable, "-m", "gpu_serde", "devices", "--json"],
        env=sim_env(bare),
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(done.stdout)
    assert doc["devices"] == [] and doc["simulated"] is True
    assert f"is a UUID without its 'GPU-' prefix; write 'GPU-{bare}'" in doc["reason"]


def test_output_to_a_reader_that_went_away_ends_quietly(sim_env):
    import os

    reader, writer = os.pipe()
    os.close(reader)  # `gpu-serde devices --json | head -0`: nobody reads
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpu_serde", "devices", "--json"],
            env=sim_env(),
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(writer)
    assert (done.returncode, done.stderr) == (141, "")


def test_a_broken_connection_is_still_an_error_while_stdout_is_fine(monkeypatch):
    from gpu_serde.tools import cli

    def lost(args):
        raise BrokenPipeError(32, "Broken pipe")  # a worker's socket, not stdout

    monkeypatch.setattr(cli, "_devices", lost)
    with pytest.raises(BrokenPipeError):
        cli.main(["devices"])


def test_a_missing_engine_is_one_line_naming_the_extra():
    # `None` in sys.modules makes `import ray` fail as if Ray were not installed
    done = gpu_serde_cli("doctor", "--ray", "127.0.0.1:1", prelude="sys.modules['ray'] = None")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu-serde: doctor needs ray, which is not installed here: pip install 'ray>=2.50' "
        "(gpu_serde's [ray] extra)"
    ]


def in_shell(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``script`` in bash, with ``gpu-serde`` meaning this Python's ``python -m gpu_serde``."""
    prelude = f'gpu-serde() {{ "{sys.executable}" -m gpu_serde "$@"; }}\n'
    return subprocess.run(
        ["bash", "-c", prelude + script], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_shell_gets_simulated_gpus_from_one_command_and_gives_them_back():
    from gpu_serde.testing import make_gpus
    from helpers import env_without_driver

    script = """
    eval "$(gpu-serde simulate 3)"
    gpu-serde devices --json
    eval "$(gpu-serde simulate --off)"
    echo "after: ${GPU_SERDE_SIM_GPUS-unset} [${LD_LIBRARY_PATH-unset}]"
    """
    done = in_shell(script, {**env_without_driver(), "LD_LIBRARY_PATH": "/opt/mine"})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert [d["uuid"] for d in doc["devices"]] == [g.uuid for g in make_gpus(3)]
    assert doc["simulated"] is True
    assert done.stdout.splitlines()[-1] == "after: unset [/opt/mine]"


def test_simulate_runs_one_command_on_simulated_gpus():
    from helpers import env_without_driver

    code = "import gpu_serde; print(len(gpu_serde.visible_devices()))"
    done = in_shell(f"gpu-serde simulate 2 -- '{sys.executable}' -c '{code}'", env_without_driver())
    assert done.stdout.strip() == "2", done.stderr


def test_simulate_with_nothing_after_the_dashes_says_what_it_takes():
    done = gpu_serde_cli("simulate", "2", "--")
    assert done.returncode == 2
    assert "nothing to run after '--'" in done.stderr and done.stdout == ""


def test_simulate_without_a_count_runs_the_command_after_the_dashes_on_four_gpus():
    from helpers import env_without_driver

    code = "import gpu_serde; print(len(gpu_serde.visible_devices()))"
    done = in_shell(f"gpu-serde simulate -- '{sys.executable}' -c '{code}'", env_without_driver())
    assert done.stdout.strip() == "4", done.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("simulate", "4", "app.py"), "a command goes after '--' (gpu-serde simulate 4 -- app.py)"),
        (("simulate", "--off", "3"), "simulate --off takes no COUNT"),
        (("simulate", "--off", "--", "app.py"), "simulate --off runs no command"),
        (("devices", "--", "app.py"), "devices runs no command: nothing goes after '--'"),
        (
            ("doctor", "--scheduler", "tcp://127.0.0.1:9", "--node-ip-address", "127.0.0.1"),
            "--node-ip-address is for --ray only",
        ),
    ],
)
def test_the_cli_refuses_what_it_would_otherwise_misread_or_ignore(args, says):
    done = gpu_serde_cli(*args)
    assert done.returncode == 2 and says in done.stderr and done.stdout == ""


def test_simulate_of_a_command_that_is_not_there_exits_as_a_shell_does():
    done = gpu_serde_cli("simulate", "1", "--", "no-such-command-here")
    assert done.returncode == 127
    assert "cannot run 'no-such-command-here': No such file or directory" in done.stderr


def test_devices_without_a_driver_points_to_simulated_gpus():
    from helpers import env_without_driver

    done = in_shell("gpu-serde devices", env_without_driver())
    assert 'eval "$(gpu-serde simulate 4)"' in done.stdout.splitlines()[-1]


def test_an_unreachable_scheduler_is_one_line():
    done = gpu_serde_cli("doctor", "--scheduler", "tcp://127.0.0.1:9", "--timeout", "2")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpu-serde: doctor: cannot reach the cluster at 'tcp://127.0.0.1:9'")


def test_an_address_that_is_no_address_is_one_line_with_what_was_wrong_escaped():
    done = gpu_serde_cli("doctor", "--scheduler", "garbage\x1b[31m", "--timeout", "5")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpu-serde: doctor: 'garbage\\x1b[31m' is not a cluster's address: ")
    assert "no spaces, line breaks or control characters" in line
    assert "\x1b" not in line


def test_an_address_distributed_cannot_parse_is_one_line_with_its_reason():
    done = gpu_serde_cli("doctor", "--scheduler", "garbage", "--timeout", "5")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpu-serde: doctor: 'garbage' is not a cluster's address: ")
    assert "missing port number" in line  # distributed's reason


RAY_NONE = [
    ("127.0.0.1:-5", "the port must be a number from 1 to 65535, not '-5'"),
    ("127.0.0.1:70000", "the port must be a number from 1 to 65535, not '70000'"),
    ("127.0.0.1:\u00b2", "the port must be a number from 1 to 65535, not '\u00b2'"),
    (":6379", "no host before the port"),
    ("tcp://127.0.0.1:8786", "use --scheduler for Dask"),
    ("http://127.0.0.1:8265", "http:// is the Ray dashboard's address"),
    ("", "the address is empty"),
    ("local", "'local' starts a new Ray cluster in the doctor's own process"),
    ("127.0.0.1:6379\n", "no spaces, line breaks or control characters"),
]
SCHEDULER_NONE = [
    ("", "the address is empty"),
    ("tcp://127.0.0.1:99999", "the port must be a number from 1 to 65535, not '99999'"),
    ("tcp://127.0.0.1:8786\n", "no spaces, line breaks or control characters"),
    ("tls://127.0.0.1:8786", "tls:// needs TLS settings (certificates)"),
    ("ray://127.0.0.1:10001", "ray:// is not a Dask scheduler's address"),
    ("inproc://x", "inproc:// is a scheduler inside one process"),
    ("[::1]:99999", "the port must be a number from 1 to 65535, not '99999'"),
    ("[::1", "an IPv6 address is written [host]:port"),
]


@pytest.mark.parametrize(
    ("flag", "address", "says"),
    [("--ray", *case) for case in RAY_NONE] + [("--scheduler", *case) for case in SCHEDULER_NONE],
)
def test_an_address_the_doctor_cannot_use_is_one_line_at_once(flag, address, says):
    done = gpu_serde_cli("doctor", flag, address, "--timeout", "30")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpu-serde: doctor: '") and " is not a cluster's address: " in line
    assert says in line


@pytest.mark.parametrize("seconds", ["inf", "1e10", "86401"])
def test_a_timeout_beyond_a_day_is_refused_by_the_parser(seconds):
    done = gpu_serde_cli("doctor", "--scheduler", "tcp://127.0.0.1:9", "--timeout", seconds)
    assert done.returncode == 2
    assert "at most 86,400 (a day)" in done.stderr and "Traceback" not in done.stderr


def test_a_negative_expect_is_refused_by_the_parser():
    done = gpu_serde_cli("doctor", "--scheduler", "tcp://127.0.0.1:9", "--expect", "-1")
    assert done.returncode == 2
    assert "must be 0 or more" in done.stderr


def test_an_engines_long_decimals_are_rounded_and_addresses_kept():
    from gpu_serde.tools.cli import _LONG_SECONDS

    said = "Timed out trying to connect to tcp://10.100.0.1:8786 after 2.9999862929980736 s"
    got = _LONG_SECONDS.sub(lambda m: f"{float(m.group()):.1f}", said)
    assert got == "Timed out trying to connect to tcp://10.100.0.1:8786 after 3.0 s"


def test_an_expect_that_is_no_number_says_what_it_takes():
    done = gpu_serde_cli("doctor", "--scheduler", "tcp://127.0.0.1:9", "--expect", "abc")
    assert done.returncode == 2
    assert "argument --expect: a whole number, 0 or more, not 'abc'" in done.stderr
    assert "_non_negative" not in done.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("simulate", "abc"), "argument COUNT: a number of GPUs, 1 to 64, not 'abc'"),
        (("simulate", "65"), "must be 1 to 64 GPUs, not 65"),
        (("simulate", "\uff13"), "argument COUNT: a number of GPUs, 1 to 64, not '\uff13'"),
    ],
)
def test_a_count_that_is_not_one_says_what_it_takes(args, says):
    done = gpu_serde_cli(*args)
    assert done.returncode == 2
    assert says in done.stderr and "_positive" not in done.stderr


def test_register_names_the_client_type_it_takes():
    with pytest.raises(TypeError, match=r"takes a distributed.Client, not str"):
        gpu_serde.dask.register("nope")


@pytest.mark.parametrize("bad", [5, "env", ["a"]])
def test_runtime_env_names_the_dict_it_takes(bad):
    with pytest.raises(TypeError, match="must be a dict or None"):
        gpu_serde.ray.runtime_env(bad)


def test_the_env_hook_installs_the_driver_and_adds_the_worker_hook_and_the_mark():
    import pickle

    from cuda.core import Device

    assert b"gpu_serde" not in pickle.dumps(Device(0))  # not installed before the hook runs
    try:
        env = gpu_serde.ray.runtime_env_hook({"env_vars": {"A": "1"}})
        assert env == {
            "env_vars": {"A": "1", gpu_serde.ray.DRIVER_MARK: "1"},
            "worker_process_setup_hook": gpu_serde.ray.HOOK,
        }
        assert (
            gpu_serde.ray.runtime_env_hook(None)["worker_process_setup_hook"] == gpu_serde.ray.HOOK
        )
        assert b"gpu_serde" in pickle.dumps(Device(0))  # this (driver) process sends by UUID
    finally:
        gpu_serde.uninstall()


def test_a_ray_address_where_nothing_listens_is_said_at_once():
    from gpu_serde.testing.clusters import free_port

    address = f"127.0.0.1:{free_port()}"
    done = gpu_serde_cli("doctor", "--ray", address, "--timeout", "5")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"gpu-serde: doctor: cannot reach the cluster at '{address}': nothing answers there "
        "(Connection refused): is the cluster running? `ray start --head` prints its address "
        "(host:port of the GCS, port 6379 unless --port says otherwise)"
    ]


@pytest.mark.parametrize("scheme", ["tcp://", ""])
def test_a_dask_scheduler_address_that_refuses_throughout_the_timeout_says_so(scheme):
    from gpu_serde.testing.clusters import free_port

    address = f"{scheme}127.0.0.1:{free_port()}"  # a scheduler still starting gets --timeout
    done = gpu_serde_cli("doctor", "--scheduler", address, "--timeout", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"gpu-serde: doctor: cannot reach the cluster at '{address}': nothing answered there "
        "within 2 s (Connection refused): is the scheduler running? `dask scheduler` prints its "
        "address (tcp://host:port, port 8786 by default)"
    ]
