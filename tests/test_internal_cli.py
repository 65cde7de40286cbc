"""`pdserve internal PATH`: an operator reads a running router's /internal routes, signed with
the deployment's cluster secret (plain curl gets 401), and is told clearly when the secret is
wrong or the server says no."""

import json
import os
import subprocess
import sys

import pytest

from pdserve import auth
from pdserve.cli import main
from pdserve.internal_cli import internal_path
from pdserve.testing.cluster import Cluster

pytestmark = pytest.mark.integration

ENGINE = ["--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "64", "--kv-transport", "tcp"]


def token_file(path, secret: bytes) -> str:
    path.write_bytes(secret + b"\n")
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(tiny_model_dir, worker_args=ENGINE + ["--no-calibrate"]) as c:
        yield c


def internal(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["internal", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_reads_the_routers_workers_with_the_deployments_secret(cluster, tmp_path, capsys):
    good = token_file(tmp_path / "token", cluster.secret)
    rc, out, err = internal(capsys, "workers", "--url", cluster.url, "--cluster-token-file", good)
    assert rc == 0, err
    workers = json.loads(out)["workers"]
    assert sorted(w["role"] for w in workers if w["alive"]) == ["decode", "prefill"]
    assert out.startswith("{\n  ")  # pretty-printed

    # the /internal/ prefix may be written out; the secret may come from the environment
    env = {**os.environ, auth.TOKEN_ENV: cluster.secret.decode()}
    env.pop(auth.TOKEN_FILE_ENV, None)
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "internal", "/internal/conductor", "--url", cluster.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "recommended_nd_per_np" in json.loads(r.stdout)


def test_a_wrong_secret_is_a_clear_error_and_a_nonzero_exit(cluster, tmp_path, capsys):
    wrong = token_file(tmp_path / "wrong", auth.new_token().encode())
    rc, out, err = internal(capsys, "workers", "--url", cluster.url, "--cluster-token-file", wrong)
    assert rc == 1 and out == ""
    assert "GET /internal/workers: 401" in err
    assert "refused this cluster secret" in err and "--cluster-token-file" in err

    rc, _, err = internal(capsys, "workers", "--url", cluster.url, "--cluster-token-file", str(tmp_path / "none"))
    assert rc == 2 and "cannot read the cluster token file" in err


def test_data_posts_json_and_the_servers_refusal_is_shown(cluster, tmp_path, capsys):
    good = token_file(tmp_path / "token", cluster.secret)
    base = ["--url", cluster.url, "--cluster-token-file", good]
    rc, out, err = internal(capsys, "admin/scale", *base, "--data", '{"decode": "1"}')
    assert rc == 0, err
    assert json.loads(out)["wanted"]["decode"] == 1

    rc, out, err = internal(capsys, "admin/scale", *base, "--data", '{"decode": "-5"}')
    assert rc == 1 and out == ""
    assert "POST /internal/admin/scale: 400: " in err

    rc, _, err = internal(capsys, "admin/scale", *base, "--data", "{not json")
    assert rc == 2 and "--data is not JSON" in err


def test_an_unreachable_url_says_so(tmp_path, capsys):
    from pdserve.ports import free_port

    good = token_file(tmp_path / "token", auth.new_token().encode())
    rc, _, err = internal(capsys, "workers", "--url", f"http://127.0.0.1:{free_port()}", "--cluster-token-file", good)
    assert rc == 1 and "cannot reach" in err


def test_paths():
    for p in ("workers", "/workers", "internal/workers", "/internal/workers"):
        assert internal_path(p) == "/internal/workers"
    assert internal_path("admin/pools") == "/internal/admin/pools"
