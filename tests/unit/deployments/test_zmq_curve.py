"""CURVE on the ZeroMQ door (deployments/doors/zmq.py, `zmq.curve`), over a real ROUTER socket in process (the door
of tests/support/zmq_door.py): a client holding the server's public key and an allowed key pair
round-trips; an RLDX-1-shaped plain peer and a peer with an unknown key get no reply within a bound while the door keeps
serving the others; our client names each refusal (`SecureChannelError`). Plus the `zmq.curve` config checks and the key
CLI."""

from __future__ import annotations

import re
import socket
import struct
import threading
import time

import numpy as np
import pytest
import zmq

from deployments.doors.zmq import curve_allowed_clients
from dreamzero.zmq_keys_cli import main as zmq_keys_main
from dreamzero.zmq_keys_cli import make_key_pair
from dreamzero_client.errors import ConfigError, SecureChannelError
from dreamzero_client.zmq_client import CLOSED_HANDSHAKES, ZmqPolicyClient
from dreamzero_client.zmq_keys import read_public_key, read_secret_key
from serve_graph.config import parse_app_args
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2
from tests.support.rldx import RldxShapedClient, droid_rldx_observation
from tests.support.zmq_door import TOKEN, start_zmq_door

#: how long a refused peer waits for a reply that must not come
SILENCE_S = 1.5
#: a refusal takes 0.2-2 s (a loaded machine's plain client sees only reset handshakes and is told after
#: CLOSED_HANDSHAKES of them, ~0.1 s apart); a refusal the client missed would wait for this reply timeout
REPLY_TIMEOUT_S = 120
#: a plain client to a CURVE server: the mismatch, or (a loaded machine) the resets before it reads the greeting
PLAIN = ("(the server requires CURVE: pass server_key|does the server require CURVE \\(pass server_key\\))",
         {"mechanism mismatch", "handshake closed"})  # fmt: skip


@pytest.fixture(scope="module")
def episode_dir(tmp_path_factory):
    episodes = random_episodes(2, {"observation.state": 8, "action": 8}, seed=3, lengths=[12, 40])
    return write_v2(tmp_path_factory.mktemp("ds") / "ds", episodes, modality=DROID_MODALITY)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    return {name: make_key_pair(folder, name) for name in ("server", "robot", "stranger")}


def _stop(door, loop, thread) -> None:
    loop.call_soon_threadsafe(door.killed.set)
    thread.join(10)
    assert not thread.is_alive()


def _raw_req(port: int, curve: tuple[bytes, bytes, bytes] | None = None):
    """A bare REQ socket, optionally CURVE (server public, own public, own secret): what any other peer could send."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(SILENCE_S * 1000))
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(f"tcp://127.0.0.1:{port}")
    return ctx, sock


def test_curve_door_with_an_allow_list(episode_dir, keys):
    server_pub, server_secret = keys["server"]
    robot_pub, robot_secret = keys["robot"]
    robot_key = read_public_key(robot_pub, "robot").decode()
    curve = {"secret_key_file": str(server_secret), "client_keys": [robot_key]}
    door, loop, thread, port, _ = start_zmq_door(episode_dir, request_timeout_s=20, curve=curve)
    good = ZmqPolicyClient("127.0.0.1", port, 20, TOKEN, server_key=server_pub, client_key_file=robot_secret)
    try:
        assert good.ping()
        action, info = good.get_action(droid_rldx_observation(), {"session_ids": ["arm"]})
        assert action["action.joint_position"].shape == (1, 24, 7) and info["sessions"][0]["session_id"] == "arm"

        # an RLDX-1-shaped plain peer: the handshake never completes, no message reaches the door, no reply
        plain = RldxShapedClient(port, TOKEN, timeout_s=SILENCE_S)
        try:
            t0 = time.monotonic()
            plain.send("ping", requires_input=False)
            with pytest.raises(zmq.Again):
                plain.receive()
            assert time.monotonic() - t0 < SILENCE_S + 1.0
        finally:
            plain.close()
        # a CURVE peer whose key is not listed: refused by ZAP during the handshake, no reply
        stranger_pub, stranger_secret = zmq.curve_keypair()
        server_key = read_public_key(server_pub, "server")
        ctx, sock = _raw_req(port, (server_key, stranger_pub, stranger_secret))
        try:
            sock.send(b"\x81\xa8endpoint\xa4ping")  # msgpack {"endpoint": "ping"}
            with pytest.raises(zmq.Again):
                sock.recv()
        finally:
            sock.close(linger=0)
            ctx.term()

        # our client names each refusal as soon as ZeroMQ reports it
        refusals = {
            "plain": (dict(server_key=None), *PLAIN),
            "unknown key": (
                dict(server_key=server_pub, client_key_file=keys["stranger"][1]),
                re.escape("refused this client's key (ZAP status 400): the server lets in only the public keys in its "
                          "zmq.curve.client_keys"),
                {"ZAP status 400"},
            ),
        }  # fmt: skip
        for kwargs, message, reasons in refusals.values():
            with ZmqPolicyClient("127.0.0.1", port, REPLY_TIMEOUT_S, TOKEN, **kwargs) as client:
                t0 = time.monotonic()
                with pytest.raises(SecureChannelError, match=message) as refused:
                    client.ping()
                assert refused.value.reason in reasons and time.monotonic() - t0 < REPLY_TIMEOUT_S / 2
        # the wrong server key: the server cannot read the client's hello and closes; said at the reply timeout
        with ZmqPolicyClient("127.0.0.1", port, SILENCE_S, TOKEN, server_key=keys["stranger"][0]) as client:
            with pytest.raises(SecureChannelError, match="closed every handshake .* is server_key the server's public"):
                client.ping()

        # the door still serves the allowed client, on the same socket
        assert good.ping()
        action, _ = good.get_action(droid_rldx_observation(), {"session_ids": ["arm"]})
        assert np.isfinite(action["action.joint_position"]).all()
    finally:
        good.close()
        _stop(door, loop, thread)


def test_curve_door_without_an_allow_list_takes_any_key_holder(episode_dir, keys, monkeypatch):
    public, secret = (k.decode() for k in read_secret_key(keys["server"][1], "server"))
    monkeypatch.setenv("DZ_TEST_ZMQ_SECRET", secret)
    door, loop, thread, port, _ = start_zmq_door(episode_dir, curve={"secret_key_env": "DZ_TEST_ZMQ_SECRET"})
    try:
        with ZmqPolicyClient("127.0.0.1", port, REPLY_TIMEOUT_S, TOKEN, server_key=public) as client:  # a fresh pair
            assert client.ping()
        # the refusal's bound as in the other tests (a 20 s one was too short under CI load)
        with ZmqPolicyClient("127.0.0.1", port, REPLY_TIMEOUT_S, TOKEN) as client:
            with pytest.raises(SecureChannelError, match="requires? CURVE"):
                client.ping()
    finally:
        _stop(door, loop, thread)


def test_zmq_curve_config_errors_name_the_field(keys, tmp_path, monkeypatch):
    pub, secret = keys["server"]
    monkeypatch.delenv("DZ_TEST_UNSET", raising=False)
    (tmp_path / "empty").mkdir()
    cases = {
        "no secret": ({}, "give the server's secret key as exactly one of secret_key_file or secret_key_env"),
        "both": (
            {"secret_key_file": str(secret), "secret_key_env": "X"},
            "give the server's secret key as exactly one of secret_key_file or secret_key_env",
        ),
        "public file": ({"secret_key_file": str(pub)}, "secret_key_file: '" + str(pub) + "' holds no secret-key"),
        "missing file": ({"secret_key_file": str(tmp_path / "nope")}, "secret_key_file: cannot read"),
        "unset env": ({"secret_key_env": "DZ_TEST_UNSET"}, "secret_key_env names 'DZ_TEST_UNSET', which is unset"),
        "bad client key": (
            {"secret_key_file": str(secret), "client_keys": ["not-a-key"]},
            "client_keys[0]: expected a CURVE key in Z85 (40 characters), got 9 characters",
        ),
        "empty dir": (
            {"secret_key_file": str(secret), "client_keys_dir": str(tmp_path / "empty")},
            "holds no client certificate (*.key)",
        ),
    }
    for name, (curve, message) in cases.items():
        with pytest.raises(ConfigError) as bad:
            parse_app_args({"zmq": {"port": 5555, "curve": curve}})
        assert "args.zmq.curve" in str(bad.value) and message in str(bad.value), (name, str(bad.value))
    ok = parse_app_args({"zmq": {"curve": {"secret_key_file": str(secret), "client_keys_dir": str(pub.parent)}}})
    assert curve_allowed_clients(ok.zmq.curve) == {
        read_public_key(keys[n][0], n) for n in ("server", "robot", "stranger")
    }
    _, secret_key = read_secret_key(secret, "server")
    assert secret_key.decode() not in repr(ok.model_dump())  # the settings carry the file's path, never the key
    with pytest.raises(ConfigError, match="client_key_file: CURVE needs the server's public key too"):
        ZmqPolicyClient("127.0.0.1", 1, client_key_file=secret)


def test_key_pair_cli(tmp_path, capsys):
    assert zmq_keys_main([str(tmp_path), "door"]) == 0
    public = read_public_key(tmp_path / "door.key", "door").decode()
    assert f"public key {public}" in capsys.readouterr().out
    assert (tmp_path / "door.key_secret").stat().st_mode & 0o077 == 0
    assert zmq_keys_main([str(tmp_path), "door"]) == 2  # never overwrites a pair
    assert "exists already" in capsys.readouterr().err


def test_curve_client_against_a_plain_server_says_so(keys):
    ctx = zmq.Context()
    plain = ctx.socket(zmq.ROUTER)  # the door without zmq.curve is a plain ROUTER
    port = plain.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ZmqPolicyClient("127.0.0.1", port, REPLY_TIMEOUT_S, server_key=keys["server"][0]) as client:
            # the mismatch, or (a loaded machine) the resets before the client reads the greeting
            with pytest.raises(
                SecureChannelError, match=r"(the server does not use CURVE|does the server use CURVE\?)$"
            ):
                client.ping()
    finally:
        plain.close(linger=0)
        ctx.term()


def test_a_plain_client_whose_every_handshake_is_reset_names_curve():
    """A CURVE server that resets the connection before the client reads its greeting shows the client no mechanism
    mismatch, only closed handshakes: that is a secure-channel error naming CURVE, not a silent
    timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port, stop = listener.getsockname()[1], threading.Event()

    def reset_every_connection() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(2)
            conn.recv(10)  # the client's ZMTP signature
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            conn.close()

    thread = threading.Thread(target=reset_every_connection, daemon=True)
    thread.start()
    try:
        with ZmqPolicyClient("127.0.0.1", port, timeout_s=REPLY_TIMEOUT_S) as client:
            t0 = time.monotonic()
            with pytest.raises(SecureChannelError, match=f"closed every handshake \\({CLOSED_HANDSHAKES} in a row"):
                client.ping()
            assert time.monotonic() - t0 < REPLY_TIMEOUT_S / 4  # told after the resets, not at the reply timeout
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
