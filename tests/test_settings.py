"""Where configuration comes from (settings.py) and what a Config accepts (config.py).

The loaders layer a real TOML file, a real environment mapping and real parsed
flags; the socket resolver is checked through every client that uses it: the
CLI's parser, ``Client()``, the vLLM integration (which must actually connect to
the path) and the daemon's own config.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading

import pytest

from ascendbind import integrations
from ascendbind.cli import build_parser
from ascendbind.client import Client
from ascendbind.values.config import DEFAULT_SOCKET, KEYS, Config, coerce, from_layers
from ascendbind.errors import ConfigError
from ascendbind.settings import add_config_flags, config_from_args, load_config, resolve_socket
from ascendbind.verbs import _socket_of


# ---------------------------------------------------------------- the pure Config


def test_a_config_checks_its_values_however_it_is_made():
    with pytest.raises(ConfigError, match="key 'topology_policy' must be one of"):
        Config(topology_policy="strict")
    with pytest.raises(ConfigError, match="key 'max_numa_nodes' must be at least 1"):
        Config().replace(max_numa_nodes=0)
    with pytest.raises(ConfigError, match="key 'reconcile_seconds': expected a finite number"):
        Config(reconcile_seconds=float("inf"))
    with pytest.raises(ConfigError, match="explicit names no key: bogus"):
        Config(explicit=frozenset({"bogus"}))
    for passes in (0, -1, 1001):
        with pytest.raises(ConfigError, match=f"key 'drift_sweep_passes' must be from 1 to 1000; got {passes}"):
            Config(drift_sweep_passes=passes)
    assert load_config(None, env={"ASCENDBIND_DRIFT_SWEEP_PASSES": "1"}).drift_sweep_passes == 1
    # text from any source is typed the way the loaders type it
    cfg = Config(irq_binding="off", max_numa_nodes="4", command_timeout_seconds=2)
    assert cfg.irq_binding is False and cfg.max_numa_nodes == 4 and cfg.command_timeout_seconds == 2.0
    assert type(cfg.command_timeout_seconds) is float
    assert cfg == Config(irq_binding=False, max_numa_nodes=4, command_timeout_seconds=2.0)


def test_coerce_names_its_source_and_suggests_a_key():
    with pytest.raises(ConfigError) as err:
        coerce("smal_pool", "share", "somewhere")
    assert str(err.value) == "somewhere: unknown key 'smal_pool' (did you mean 'small_pool'?)"
    assert coerce("small_pool", "share", "x") == "share"


def test_layers_later_win_and_set_keys_count_as_explicit():
    cfg = from_layers([("a", {"small_pool": "share", "max_numa_nodes": 2}),
                       ("b", {"max_numa_nodes": "3", "topology_policy": None})])
    assert cfg.small_pool == "share" and cfg.max_numa_nodes == 3 and cfg.topology_policy == "none"
    assert cfg.explicit == frozenset({"small_pool", "max_numa_nodes"})
    assert from_layers([]) == Config() and set(KEYS) == {f for f in Config.__dataclass_fields__} - {"explicit"}


# ---------------------------------------------------------------- the loaders


def _parse(*argv: str):
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return p.parse_args(list(argv))


def test_file_then_environment_then_flags_through_a_real_parser(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text('topology_policy = "restricted"\nsmall_pool = "share"\nmax_numa_nodes = 4\nsocket = "/x/f.sock"\n')
    env = {"ASCENDBIND_CONFIG": str(f), "ASCENDBIND_TOPOLOGY_POLICY": "best-effort", "ASCENDBIND_MAX_NUMA_NODES": "2"}
    cfg = config_from_args(_parse("--topology-policy", "single-numa-node"), env=env)
    assert (cfg.topology_policy, cfg.max_numa_nodes, cfg.small_pool, cfg.socket) == \
        ("single-numa-node", 2, "share", "/x/f.sock")
    assert cfg.explicit == frozenset({"topology_policy", "small_pool", "max_numa_nodes", "socket"})
    # without the flag the environment wins over the file; without both, the file
    assert config_from_args(_parse(), env=env).topology_policy == "best-effort"
    assert config_from_args(_parse(), env={"ASCENDBIND_CONFIG": str(f)}).topology_policy == "restricted"
    # --config beats ASCENDBIND_CONFIG; ASCENDBIND_CONFIG="" reads no file at all
    other = tmp_path / "other.toml"
    other.write_text('small_pool = "fail"\n')
    assert config_from_args(_parse("--config", str(other)), env={"ASCENDBIND_CONFIG": str(f)}).explicit == {"small_pool"}
    assert config_from_args(_parse(), env={"ASCENDBIND_CONFIG": ""}) == Config()


def test_a_flag_value_error_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="option --max-numa-nodes: key 'max_numa_nodes'"):
        config_from_args(_parse("--max-numa-nodes", "0"), env={"ASCENDBIND_CONFIG": ""})
    with pytest.raises(ConfigError, match="unknown option 'sockets'"):
        load_config(None, env={"ASCENDBIND_CONFIG": ""}, overrides={"sockets": "/x"})


# ---------------------------------------------------------------- one socket resolver


def _scenarios(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text(f'socket = "{tmp_path}/from-file.sock"\n')
    return [
        ({"ASCENDBIND_CONFIG": ""}, DEFAULT_SOCKET),
        ({"ASCENDBIND_CONFIG": str(f)}, f"{tmp_path}/from-file.sock"),
        ({"ASCENDBIND_CONFIG": str(f), "ASCENDBIND_SOCKET": f"{tmp_path}/from-env.sock"}, f"{tmp_path}/from-env.sock"),
        ({"ASCENDBIND_SOCKET": f"{tmp_path}/from-env.sock"}, f"{tmp_path}/from-env.sock"),
    ]


def test_the_cli_the_client_and_the_daemon_agree_on_the_socket(tmp_path, monkeypatch):
    for env, want in _scenarios(tmp_path):
        monkeypatch.delenv("ASCENDBIND_SOCKET", raising=False)
        monkeypatch.delenv("ASCENDBIND_CONFIG", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        cli = {verb: _socket_of(build_parser().parse_args([verb, *rest])) for verb, rest in
               (("status", []), ("bind", ["--pid", "1"]), ("release", ["--all"]), ("run", ["--npu", "0", "true"]))}
        assert cli == dict.fromkeys(cli, want), env
        assert Client().socket_path == want, env
        assert load_config(None).socket == want, env  # where `serve` listens with the same environment
        assert resolve_socket() == want, env


def test_flags_name_the_socket_or_its_file_for_the_cli(tmp_path, monkeypatch):
    f = tmp_path / "node.toml"
    f.write_text(f'socket = "{tmp_path}/named.sock"\n')
    monkeypatch.setenv("ASCENDBIND_CONFIG", "")
    monkeypatch.delenv("ASCENDBIND_SOCKET", raising=False)
    args = build_parser().parse_args(["status", "--config", str(f)])
    assert _socket_of(args) == f"{tmp_path}/named.sock" == load_config(str(f)).socket
    args = build_parser().parse_args(["status", "--config", str(f), "--socket", "/s/flag.sock"])
    assert _socket_of(args) == "/s/flag.sock"
    # a named file that cannot be read is the operator's error; any other is skipped
    with pytest.raises(ConfigError, match="does not exist"):
        _socket_of(build_parser().parse_args(["status", "--config", str(tmp_path / "missing.toml")]))
    monkeypatch.setenv("ASCENDBIND_CONFIG", str(tmp_path / "missing.toml"))
    assert Client().socket_path == DEFAULT_SOCKET
    broken = tmp_path / "broken.toml"
    broken.write_text("socket = [1, 2\n")
    monkeypatch.setenv("ASCENDBIND_CONFIG", str(broken))
    assert resolve_socket() == DEFAULT_SOCKET
    with pytest.raises(ConfigError, match="broken.toml"):
        resolve_socket(config_path=str(broken))


def _answer_one_bind(server: socket.socket, seen: list) -> None:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(4096)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += conn.recv(4096)
        seen.append((head.split(b"\r\n")[0].decode(), json.loads(body)))
        out = json.dumps({"pid": 1, "npus": [0], "outcome": "aligned"}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(out), out))


def test_the_vllm_integration_connects_to_the_socket_the_config_file_names(tmp_path, monkeypatch):
    path = str(tmp_path / "from-file.sock")
    f = tmp_path / "node.toml"
    f.write_text(f'socket = "{path}"\n')
    monkeypatch.delenv("ASCENDBIND_SOCKET", raising=False)
    monkeypatch.setenv("ASCENDBIND_CONFIG", str(f))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(30)
    seen: list = []
    t = threading.Thread(target=_answer_one_bind, args=(server, seen), daemon=True)
    t.start()
    try:
        answer = integrations.bind_current_process(npu=0, timeout=10, retry_delays=())
        t.join(30)
    finally:
        server.close()
    assert answer == {"pid": 1, "npus": [0], "outcome": "aligned"}
    assert seen == [("POST /v1/bind HTTP/1.1", {"npu": 0})]
