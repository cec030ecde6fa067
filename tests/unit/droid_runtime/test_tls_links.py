"""The DROID links (`dreamzero_droid.links`) and the command lines (`dreamzero-eval`, `dreamzero-eval-libero`,
`dreamzero-franka`) over TLS: `--ca-bundle` beside every server URL option, against the servers of
the robot client's own TLS tests (tests/unit/client/test_tls.py; the fixtures: tests/unit/conftest.py)."""

from __future__ import annotations

import pytest

from dreamzero_client.errors import ConfigError, SecureChannelError
from dreamzero_droid.links import HttpLink, OpenPILink, connect
from tests.support.tls import HANDSHAKE


def test_both_links_reach_the_server_verified_by_the_ca_bundle(pki, tls_servers):
    port = tls_servers["good"]
    link = connect(f"wss://localhost:{port}/ws", ca_bundle=str(pki.ca), timeout_s=10)
    try:
        assert isinstance(link, OpenPILink) and link.open() == HANDSHAKE
    finally:
        link.close()
    link = connect(f"https://localhost:{port}", ca_bundle=str(pki.ca), timeout_s=10)
    try:
        assert isinstance(link, HttpLink) and link.client.health()["scheme"] == "https"
    finally:
        link.close()


def test_link_ca_bundle_errors_name_the_field(pki, tmp_path):
    with pytest.raises(ConfigError, match=r"^--server: a CA bundle was given for a http:// URL"):
        connect("http://localhost:1", ca_bundle=str(pki.ca), field="--server")
    with pytest.raises(ConfigError, match=r"^ca_bundle: '.*not-pem.txt' holds no readable PEM certificate"):
        (tmp_path / "not-pem.txt").write_text("hello")
        OpenPILink("wss://localhost:1", ca_bundle=str(tmp_path / "not-pem.txt"))


# --- the command lines: --ca-bundle beside every server URL option ---------------------------------------------------
def test_eval_cli_reaches_a_wss_server_with_ca_bundle(pki, tls_servers, capsys):
    from eval.cli import main, make_policy, parse_args

    url = f"wss://localhost:{tls_servers['good']}/ws"
    policy = make_policy(parse_args(["--host", url, "--ca-bundle", str(pki.ca), "--timeout-s", "10"]))
    try:
        assert isinstance(policy.link, OpenPILink) and policy.link.open() == HANDSHAKE
    finally:
        policy.close()
    assert main(["--policy", "http", "--url", "http://localhost:1", "--ca-bundle", str(pki.ca)]) == 2
    assert "--ca-bundle with --url http://localhost:1: a CA bundle was given for a http://" in capsys.readouterr().err
    assert main(["--policy", "embedded", "--ca-bundle", str(pki.ca)]) == 2
    assert "--ca-bundle: the embedded policy runs in this process" in capsys.readouterr().err
    assert main(["--host", url, "--ca-bundle", "/nonexistent/ca.pem"]) == 2
    assert "--ca-bundle: '/nonexistent/ca.pem' is not a file" in capsys.readouterr().err


def test_eval_libero_cli_refuses_a_bad_ca_bundle_before_the_simulator(pki, tls_servers, capsys, tmp_path):
    from eval.libero.cli import main

    out = ["--out", str(tmp_path)]
    assert main(["--url", "http://localhost:1", "--ca-bundle", str(pki.ca), *out]) == 2
    assert "--ca-bundle with --url http://localhost:1: a CA bundle was given" in capsys.readouterr().err
    assert main(["--url", f"https://localhost:{tls_servers['expired']}", "--ca-bundle", str(pki.ca), *out]) == 2
    assert "did not verify: certificate has expired" in capsys.readouterr().err


def test_franka_cli_takes_ca_bundle(pki, tls_servers):
    from dreamzero_droid.policy import DroidPolicy
    from dreamzero_franka.cli import DeployArgs, build_parser
    from dreamzero_franka.connect import connect_policy

    base = ["--prompt", "p", "--robot", "sim", "--cameras", "synthetic", "--embodiment", "oxe_droid"]
    url = f"wss://localhost:{tls_servers['good']}/ws"
    args = DeployArgs.from_namespace(build_parser().parse_args([*base, "--server", url, "--ca-bundle", str(pki.ca)]))
    assert args.ca_bundle == str(pki.ca)
    policy = connect_policy(args.server, args.prompt, timeout_s=10, embodiment="oxe_droid", ca_bundle=args.ca_bundle)
    try:
        assert isinstance(policy, DroidPolicy)
    finally:
        policy.close()
    with pytest.raises(SecureChannelError, match="unable to get local issuer certificate"):
        connect_policy(url, "p", timeout_s=10, embodiment="oxe_droid")  # the system store does not know the test CA
    plain = build_parser().parse_args([*base, "--server", "ws://localhost:1", "--ca-bundle", str(pki.ca)])
    with pytest.raises(ConfigError, match=r"^--ca-bundle with --server ws://localhost:1: a CA bundle was given"):
        DeployArgs.from_namespace(plain)
