"""Config: one frozen dataclass, validated eagerly, the only reader of REDSRV_* variables."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from redsrv import Config, ConfigError
from redsrv.core import constants as C
from redsrv.core.config import parse_address


def test_environment_fills_what_arguments_do_not() -> None:
    env = {"REDSRV_REDUCERS": "10.0.0.5:7000, 10.0.0.6:7001", "REDSRV_JOB": "run-17", "RANK": "3", "WORLD_SIZE": "4",
           "REDSRV_CHUNK_BYTES": "1048576", "REDSRV_WIRE_DTYPE": "bf16", "REDSRV_OP_TIMEOUT": "12.5"}
    cfg = Config.from_env(env)
    assert cfg.reducers == ("10.0.0.5:7000", "10.0.0.6:7001")
    assert (cfg.job, cfg.rank, cfg.world_size, cfg.chunk_bytes) == ("run-17", 3, 4, 1 << 20)
    assert cfg.wire_dtype == "bfloat16" and cfg.op_timeout == 12.5
    assert Config.from_env(env, rank=1, job="other").rank == 1
    assert Config.from_env({**env, "REDSRV_RANK": "3"}).rank == 3  # sources that agree are fine
    with pytest.raises(ConfigError, match="conflicting rank: REDSRV_RANK gives 2 but RANK gives 3"):
        Config.from_env({**env, "REDSRV_RANK": "2"})


def tf_config(task: dict | None, **cluster: list[str]) -> dict[str, str]:  # type: ignore[type-arg]
    import json

    return {"TF_CONFIG": json.dumps({"cluster": cluster, **({"task": task} if task else {})})}


def test_tf_config_names_workers_and_reducers() -> None:
    env = tf_config({"type": "worker", "index": 1}, chief=["c:1"], worker=["w0:1", "w1:1"], reducer=["r0:7", "r1:7"])
    cfg = Config.from_env(env)
    assert (cfg.reducers, cfg.world_size, cfg.rank) == (("r0:7", "r1:7"), 3, 2)
    assert Config.from_env(tf_config({"type": "chief", "index": 0}, chief=["c:1"], worker=["w:1"], reducer=["r:7"])).rank == 0


def test_vertex_cluster_spec() -> None:
    import json

    spec = {"cluster": {"workerpool0": ["a:1"], "workerpool1": ["b:1", "c:1"], "workerpool2": ["r:9"]},
            "task": {"type": "workerpool1", "index": 1}}
    cfg = Config.from_env({"CLUSTER_SPEC": json.dumps(spec)})
    assert (cfg.reducers, cfg.world_size, cfg.rank) == (("r:9",), 3, 2)


def test_a_reducer_binds_the_address_listed_for_its_index() -> None:
    from redsrv.core.config import reducer_bind_address

    env = tf_config({"type": "reducer", "index": 1}, worker=["w:1"], reducer=["r0:7000", "r1:7001"])
    assert reducer_bind_address(env) == ("r1", 7001)
    assert reducer_bind_address({}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TF_CONFIG": "{not json"}, "TF_CONFIG is not valid JSON"),
        ({"TF_CONFIG": '{"task": {}}'}, 'TF_CONFIG has no "cluster" object'),
        (tf_config({"type": "worker", "index": 5}, worker=["w:1"], reducer=["r:1"]), "out of range"),
        (tf_config({"type": "gardener", "index": 0}, worker=["w:1"], reducer=["r:1"]), "task type 'gardener'"),
        (tf_config({"type": "worker", "index": 0}, chief=["c:1"], master=["m:1"], reducer=["r:1"]), "lists 2 chiefs"),
        (tf_config({"type": "worker", "index": 0}, worker=["w:1"], reducer=["r:x"]), "TF_CONFIG: reducer address"),
        ({**tf_config({"type": "worker", "index": 0}, worker=["w:1", "w:2"], reducer=["r:1"]), "WORLD_SIZE": "4"},
         "conflicting world_size: TF_CONFIG gives 2 but WORLD_SIZE gives 4"),
        ({**tf_config({"type": "worker", "index": 0}, worker=["w:1"], reducer=["r:1"]), "REDSRV_REDUCERS": "other:1"},
         "conflicting reducers: REDSRV_REDUCERS gives"),
    ],
)
def test_incomplete_or_conflicting_cluster_specs(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().job = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"REDSRV_TIMEOUT": "3"}, "unknown variable"),
        ({"REDSRV_OP_TIMEOUT": "0"}, "op_timeout must be positive"),
        ({"REDSRV_HEARTBEAT_INTERVAL": "-1"}, "heartbeat_interval must be positive"),
        ({"REDSRV_OP_TIMEOUT": "soon"}, "not a valid float"),
        ({"REDSRV_RANK": "4", "REDSRV_WORLD_SIZE": "4"}, "rank must be in 0..3"),
        ({"REDSRV_REDUCERS": "host:notaport"}, "port 'notaport' is not a number"),
        ({"REDSRV_STRAGGLER_MODE": "fastest"}, "straggler_mode must be one of"),
        ({"REDSRV_STRAGGLER_MODE": "first_m", "REDSRV_WORLD_SIZE": "4", "REDSRV_RANK": "0"}, "needs min_contributors"),
        ({"REDSRV_STRAGGLER_MODE": "deadline", "REDSRV_WORLD_SIZE": "4", "REDSRV_RANK": "0", "REDSRV_MIN_CONTRIBUTORS": "2"},
         "needs a positive deadline"),
        ({"REDSRV_WIRE_DTYPE": "int8"}, "wire_dtype must be one of"),
        ({"REDSRV_SECRET": "short"}, "at least 16 bytes"),
        ({"REDSRV_SECRET_FILE": "/nonexistent/redsrv-secret"}, "cannot read secret file"),
        ({"REDSRV_CHUNK_BYTES": "0"}, "chunk_bytes must be >= 1"),
        ({"REDSRV_CHUNKS_PER_SPAN": "0"}, "chunks_per_span must be >= 1"),
        ({"REDSRV_IO_THREADS": "0"}, r"io_threads \(REDSRV_IO_THREADS\) must be in 1\.\.64, got 0"),
        ({"REDSRV_IO_THREADS": "65"}, r"must be in 1\.\.64, got 65"),
        ({"REDSRV_IO_THREADS": "two"}, "REDSRV_IO_THREADS='two' is not a valid int"),
    ],
)
def test_invalid_settings_fail_at_start_up(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env)


def test_the_reducers_own_settings_are_daemon_settings_and_their_variables_pass_through_a_worker() -> None:
    # The reducer reads these (DaemonSettings); one environment may serve workers and reducers alike.
    from redsrv.core.config import DaemonSettings

    env = {"REDSRV_RESULT_PIECE_BYTES": "0", "REDSRV_STALL_WARNING": "2.5", "REDSRV_JOB_BUDGET_BYTES": "1000"}
    settings = DaemonSettings.from_env(env)
    assert (settings.result_piece_bytes, settings.stall_warning, settings.job_budget_bytes) == (0, 2.5, 1000)
    assert Config.from_env(env) == Config.from_env({})
    with pytest.raises(ConfigError, match="result_piece_bytes must be >= 0"):
        DaemonSettings.from_env({"REDSRV_RESULT_PIECE_BYTES": "-1"})
    with pytest.raises(ConfigError, match=r"stall_warning is a reducer's setting: DaemonSettings\.stall_warning, or "
                                          "REDSRV_STALL_WARNING in a reducer's environment"):
        Config.from_env({}, stall_warning=2.5)
    with pytest.raises(ConfigError, match="chunk_bytes is a worker's setting"):
        DaemonSettings.from_env({}, chunk_bytes=1)


def test_io_threads_come_from_the_environment_or_an_argument_and_default_to_one() -> None:
    assert Config.from_env({}).io_threads == 1
    assert Config.from_env({"REDSRV_IO_THREADS": "3"}).io_threads == 3
    assert Config.from_env({"REDSRV_IO_THREADS": "3"}, io_threads=2).io_threads == 2


def test_secret_file_is_read_and_never_shown(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "secret"
    path.write_text("  correct horse battery staple  \n")
    cfg = Config.from_env({"REDSRV_SECRET_FILE": str(path)})
    assert cfg.secret == b"correct horse battery staple"
    assert "horse" not in repr(cfg)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("h:1", ("h", 1)), ("h", ("h", 29600)), ("[::1]:5", ("::1", 5)), ("[fe80::1]", ("fe80::1", 29600))],
)
def test_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "h:0", "h:70000", "[::1", ":5"])
def test_bad_addresses(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_address(text)


def test_every_command_has_help() -> None:
    import contextlib
    import io

    from redsrv.cli import build_parser

    for argv in (["--help"], ["reducer", "--help"], ["demo", "--help"], ["bench", "--help"], ["plan", "--help"],
                 ["soak", "--help"], ["timeline", "--help"], ["bench", "local", "--help"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 0 and "usage:" in out.getvalue()


def test_json_logs() -> None:
    import json
    import logging

    from redsrv.cli import _JsonFormatter

    record = logging.LogRecord("redsrv.reducer", logging.WARNING, __file__, 1, "job %r rank %d lost", ("j", 3), None)
    entry = json.loads(_JsonFormatter().format(record))
    assert entry["message"] == "job 'j' rank 3 lost" and entry["level"] == "WARNING"


def test_tcp_congestion_defaults_to_cubic_and_system_means_the_kernel_default() -> None:
    from redsrv import DaemonSettings

    assert Config().tcp_congestion == "cubic"
    assert Config.from_env({"REDSRV_TCP_CONGESTION": "BBR"}).tcp_congestion == "bbr"
    assert Config.from_env({"REDSRV_TCP_CONGESTION": "system"}).tcp_congestion is None
    assert Config.from_env({"REDSRV_TCP_CONGESTION": ""}).tcp_congestion is None
    assert Config(tcp_congestion="system").tcp_congestion is None
    assert DaemonSettings(tcp_congestion="system").tcp_congestion is None
    assert DaemonSettings().tcp_congestion == "cubic"
    for bad in ("cubic;reno", "x" * 16, "bbr v2"):
        with pytest.raises(ConfigError, match="tcp_congestion must be an algorithm name"):
            Config.from_env({"REDSRV_TCP_CONGESTION": bad})
        with pytest.raises(ConfigError, match="tcp_congestion must be an algorithm name"):
            DaemonSettings(tcp_congestion=bad)


def test_the_reducers_receive_buffer_is_autotuned_by_default_and_never_a_useless_window() -> None:
    from redsrv.core.config import DaemonSettings

    assert DaemonSettings().recv_buffer_bytes == 0
    assert DaemonSettings.from_env({"REDSRV_RECV_BUFFER_BYTES": "262144"}).recv_buffer_bytes == 256 * 1024
    assert DaemonSettings.from_env({"REDSRV_RECV_BUFFER_BYTES": "1048576"}).recv_buffer_bytes == 1 << 20
    for bad in ("-1", "4096"):
        with pytest.raises(ConfigError, match=r"recv_buffer_bytes \(REDSRV_RECV_BUFFER_BYTES\) must be 0 \(the kernel's "
                                              r"autotuning\) or at least 16384 bytes, got " + bad):
            DaemonSettings.from_env({"REDSRV_RECV_BUFFER_BYTES": bad})
    # A worker's environment may carry it (one environment serves a pod that runs either).
    assert Config.from_env({"REDSRV_RECV_BUFFER_BYTES": "262144"}).job == "default"


def test_reducer_settings_come_from_one_validated_source_with_the_workers_rules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from redsrv.core.config import DaemonSettings

    settings = DaemonSettings.from_env({"REDSRV_MEMORY_BUDGET_BYTES": "2000000000", "REDSRV_SEND_STALL_TIMEOUT": "3",
                                        "REDSRV_PORT": "7000"}, host="10.0.0.5")
    assert (settings.memory_budget_bytes, settings.send_stall_timeout, settings.port, settings.host) == (2_000_000_000, 3.0,
                                                                                                         7000, "10.0.0.5")
    with pytest.raises(ConfigError, match="unknown variable.*REDSRV_MEMORY_BUDGE"):
        DaemonSettings.from_env({"REDSRV_MEMORY_BUDGE": "1"})
    with pytest.raises(ConfigError, match="send_stall_timeout must be positive"):
        DaemonSettings.from_env({"REDSRV_SEND_STALL_TIMEOUT": "0"})
    tf_config = json.dumps({"cluster": {"worker": ["w:1"], "reducer": ["r0:29600", "r1:29601"]},
                            "task": {"type": "reducer", "index": 1}})
    assert DaemonSettings.from_env({"TF_CONFIG": tf_config}).port == 29601
    with pytest.raises(ConfigError, match="conflicting port: REDSRV_PORT gives 7000 but TF_CONFIG gives 29601"):
        DaemonSettings.from_env({"TF_CONFIG": tf_config, "REDSRV_PORT": "7000"})
    # A worker's environment may carry the reducer's variables and the other way round.
    assert Config.from_env({"REDSRV_MEMORY_BUDGET_BYTES": "1"}).job == "default"


def test_a_secret_from_any_source_obeys_the_same_length_rule(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from redsrv.core.config import DaemonSettings

    short = tmp_path / "short"
    short.write_bytes(b"four")
    for build in (lambda: DaemonSettings.from_env({}, secret_file=str(short)),
                  lambda: DaemonSettings.from_env({"REDSRV_SECRET_FILE": str(short)}),
                  lambda: DaemonSettings(secret=b"four"),
                  lambda: Config.from_env({"REDSRV_SECRET_FILE": str(short)})):
        with pytest.raises(ConfigError, match="secret must be at least 16 bytes"):
            build()
    good = tmp_path / "good"
    good.write_bytes(b"x" * 32 + b"\n")
    assert DaemonSettings.from_env({}, secret_file=str(good)).secret == b"x" * 32


def test_host_level_is_chosen_from_the_launchers_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    config = Config.from_env(env, reducers="a:1")
    assert config.host_level and config.hosts == 4 and (config.local_rank, config.local_size) == (1, 2)
    assert not Config.from_env({**env, "REDSRV_HOST_REDUCE": "flat"}, reducers="a:1").host_level
    one_host = Config.from_env({**env, "WORLD_SIZE": "2", "RANK": "1"}, reducers="a:1")
    assert not one_host.host_level  # one host: the flat path, as before
    uneven = Config.from_env({**env, "LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0"}, reducers="a:1")
    assert not uneven.host_level  # 8 is not a multiple of 3: auto stays flat
    with pytest.raises(ConfigError, match="multiple of local_size"):
        Config.from_env({**env, "LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0", "REDSRV_HOST_REDUCE": "host"}, reducers="a:1")
    with pytest.raises(ConfigError, match="conflicting local_rank"):
        Config.from_env({**env, "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, reducers="a:1")



def test_torchrun_restart_count_and_verify_collectives_from_the_environment() -> None:
    env = {"REDSRV_REDUCERS": "127.0.0.1:1", "TORCHELASTIC_RESTART_COUNT": "2", "REDSRV_VERIFY_COLLECTIVES": "on"}
    config = Config.from_env(env)
    assert (config.restart_count, config.verify_collectives) == (2, True)
    assert Config.from_env({"REDSRV_REDUCERS": "127.0.0.1:1"}).verify_collectives is None
    with pytest.raises(ConfigError, match="REDSRV_VERIFY_COLLECTIVES='maybe' is not a valid bool"):
        Config.from_env({"REDSRV_REDUCERS": "127.0.0.1:1", "REDSRV_VERIFY_COLLECTIVES": "maybe"})


def test_horovodrun_ranks_are_read_and_must_agree_with_other_launchers() -> None:
    base = {"REDSRV_REDUCERS": "127.0.0.1:1"}
    config = Config.from_env({**base, "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
                              "HOROVOD_LOCAL_SIZE": "2"})
    assert (config.rank, config.world_size, config.local_rank, config.local_size) == (1, 2, 1, 2)
    with pytest.raises(ConfigError, match="conflicting rank: RANK gives 0 but HOROVOD_RANK gives 1"):
        Config.from_env({**base, "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(("env", "what"), [
    ({"REDSRV_WORLD_SIZE": "4"}, "a world size of 4 (from REDSRV_WORLD_SIZE)"),
    ({"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"}, "a local size of 2 (from HOROVOD_LOCAL_SIZE)")])
def test_one_of_several_processes_without_a_rank_is_refused_not_made_rank_0(env: dict[str, str], what: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(what) + ".*no rank.*HOROVOD_RANK, SLURM_PROCID, TF_CONFIG"):
        Config.from_env({"REDSRV_REDUCERS": "127.0.0.1:1", **env})
    assert Config.from_env({"REDSRV_REDUCERS": "127.0.0.1:1"}).rank == 0  # a job of one needs no rank


def _tf_config(task_type: str, index: int, **extra: list[str]) -> dict[str, str]:
    cluster = {"master": ["m:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p:2222"], "evaluator": ["e:2222"], **extra}
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}


@pytest.mark.parametrize(("task_type", "index", "rank"), [("master", 0, 0), ("worker", 0, 1), ("worker", 1, 2)])
def test_a_kubeflow_tfjob_tf_config_lists_no_reducers_and_redsrv_reducers_names_them(task_type: str, index: int,
                                                                                    rank: int) -> None:
    config = Config.from_env({**_tf_config(task_type, index), "REDSRV_REDUCERS": "r0:29600,r1:29600"})
    assert (config.rank, config.world_size, config.reducers) == (rank, 3, ("r0:29600", "r1:29600"))


@pytest.mark.parametrize("task_type", ["ps", "evaluator"])
def test_parameter_servers_and_the_evaluator_are_not_training_workers(task_type: str) -> None:
    from redsrv.core.config import cluster_from_env

    spec = cluster_from_env(_tf_config(task_type, 0))
    assert spec is not None and spec.worker_index is None and spec.num_workers == 3


def test_a_reducer_list_in_tf_config_still_works_and_must_agree_with_redsrv_reducers() -> None:
    env = _tf_config("worker", 1, reducer=["r0:29600"])
    assert Config.from_env(env).reducers == ("r0:29600",)
    with pytest.raises(ConfigError, match="conflicting reducers"):
        Config.from_env({**env, "REDSRV_REDUCERS": "other:29600"})


def test_kubernetes_service_links_never_stop_a_pod(caplog) -> None:  # type: ignore[no-untyped-def]
    from redsrv.core.config import DaemonSettings

    links = {  # a Service "redsrv-metrics" and a Service "redsrv" in the namespace
        "REDSRV_METRICS_SERVICE_HOST": "10.0.0.7", "REDSRV_METRICS_SERVICE_PORT": "9090",
        "REDSRV_METRICS_PORT": "tcp://10.0.0.7:9090", "REDSRV_METRICS_PORT_9090_TCP": "tcp://10.0.0.7:9090",
        "REDSRV_METRICS_PORT_9090_TCP_ADDR": "10.0.0.7", "REDSRV_METRICS_PORT_9090_TCP_PORT": "9090",
        "REDSRV_METRICS_PORT_9090_TCP_PROTO": "tcp", "REDSRV_SERVICE_HOST": "10.0.0.9", "REDSRV_SERVICE_PORT": "29600",
        "REDSRV_SERVICE_PORT_DATA": "29600", "REDSRV_PORT": "tcp://10.0.0.9:29700"}
    with caplog.at_level("WARNING", logger="redsrv.config"):
        assert Config.from_env({"REDSRV_REDUCERS": "127.0.0.1:1", **links}).reducers == ("127.0.0.1:1",)
        assert DaemonSettings.from_env(links).port == DaemonSettings().port  # not 29700, nor an error
    assert "service-link" in caplog.text and "enableServiceLinks: false" in caplog.text
    with pytest.raises(ConfigError, match="unknown variable"):  # a real typo still stops the pod
        Config.from_env({"REDSRV_REDUCERS": "127.0.0.1:1", "REDSRV_CHUNK_BYTE": "4096"})
    assert DaemonSettings.from_env({"REDSRV_PORT": "29700"}).port == 29700


def test_the_default_chunk_follows_the_world_size_and_the_host_path_keeps_its_pieces() -> None:
    """Small jobs push 4 MiB chunks (a quarter of the per-chunk work), large ones 1 MiB (a reducer
    holds every rank's copy of an open chunk); a set chunk_bytes wins; the frame cap bounds the
    default; the host-level pieces stay those of 1 MiB chunks (constants.SMALL_WORLD_CHUNK_BYTES)."""
    reducers = ("10.0.0.5:7000", "10.0.0.6:7001")
    assert Config(reducers=reducers, world_size=8).largest_chunk_bytes == C.SMALL_WORLD_CHUNK_BYTES == 4 << 20
    assert Config(reducers=reducers, world_size=9).largest_chunk_bytes == C.DEFAULT_CHUNK_BYTES == 1 << 20
    assert Config(reducers=reducers, world_size=4, chunk_bytes=1 << 16).largest_chunk_bytes == 1 << 16
    assert Config(reducers=reducers, world_size=4, max_frame_payload=3 << 20).largest_chunk_bytes == 3 << 20
    assert Config.from_env({"REDSRV_CHUNK_BYTES": "2097152", "WORLD_SIZE": "4", "RANK": "1"},
                           reducers=reducers).largest_chunk_bytes == 2 << 20
    host = Config(reducers=reducers, world_size=4, local_size=2, local_rank=0)
    assert host.piece_bytes == 2 * C.DEFAULT_CHUNK_BYTES  # max(local workers, reducers) x 1 MiB
    # A reducer funds a default chunk whole at its header or lets it wait there (ReducerCore.begin_push), and a job's
    # least fair share is one funding step.
    assert C.WHOLE_FUNDING_MAX_BYTES >= C.SMALL_WORLD_CHUNK_BYTES and C.MIN_FAIR_SHARE_BYTES >= C.ARRIVAL_STEP_BYTES
