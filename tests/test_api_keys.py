"""API keys from --api-key-file and $SLOTSERVE_API_KEY: parsing, start-up errors, and a real
`slotserve serve` in a subprocess that requires them and never shows them (issue 27, part 5).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from slotserve.api import keys as keys_module
from slotserve.api.app import app_state, create_app
from slotserve.api.keys import ENV, APIKeyError, APIKeys, load_api_keys
from slotserve.api.server import main as serve_main
from slotserve.cli import build_parser
from slotserve.engine import EngineConfig

FILE_KEYS = ("sk-file-alpha-0001", "sk-file-beta-0002")
ENV_KEYS = ("sk-env-one-0001", "sk-env-two-0002", "sk-env-three-0003")
WRONG = "sk-wrong-guess-0009"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def key_file(tmp_path: Path, text: str, name: str = "keys") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return path


# ---- sources -------------------------------------------------------------------------------


def test_key_file_lines_comments_and_blanks(tmp_path: Path) -> None:
    path = key_file(tmp_path, f"# tenants\n\n  {FILE_KEYS[0]}  \r\n   # old: none\n"
                              f"{FILE_KEYS[1]}\n\n")
    keys = load_api_keys(file=path, environ={})
    assert len(keys) == 2 and keys.warnings == ()
    assert keys.match(FILE_KEYS[0]) == 0 and keys.match(FILE_KEYS[1]) == 1
    assert keys.match(WRONG) is None and keys.match("") is None
    assert keys.match("# tenants") is None
    assert keys.describe() == f"2 API keys (2 from --api-key-file {path})"


def test_env_keys_split_on_commas_and_newlines() -> None:
    keys = load_api_keys(environ={ENV: f" {ENV_KEYS[0]},{ENV_KEYS[1]}\n\n{ENV_KEYS[2]},\n"})
    assert [keys.match(k) for k in ENV_KEYS] == [0, 1, 2]
    assert keys.describe() == "3 API keys (3 from $SLOTSERVE_API_KEY)"


def test_all_sources_are_accepted_together(tmp_path: Path) -> None:
    path = key_file(tmp_path, "\n".join(FILE_KEYS))
    keys = load_api_keys("sk-flag-0001", path, {ENV: f"{ENV_KEYS[0]},{FILE_KEYS[0]}"})
    for key in ("sk-flag-0001", *FILE_KEYS, ENV_KEYS[0]):
        assert keys.match(key) is not None, key
    assert len(keys) == 4  # the key given twice counts once
    text = keys.describe()
    assert text.startswith("4 API keys (1 from --api-key (visible to other local users")
    assert f"2 from --api-key-file {path}" in text and "2 from $SLOTSERVE_API_KEY" in text


def test_no_source_means_no_auth() -> None:
    keys = load_api_keys(None, None, {})
    assert not keys and keys.match("anything") is None
    assert "no API key" in keys.describe()


def test_keys_are_never_shown(tmp_path: Path) -> None:
    path = key_file(tmp_path, "\n".join(FILE_KEYS))
    keys = load_api_keys("sk-flag-0001", path, {ENV: ",".join(ENV_KEYS)})
    app = create_app(EngineConfig(), api_key=keys, model_id="m")
    shown = " ".join([repr(keys), keys.describe(), repr(app_state(app).settings),
                      repr(vars(keys))])
    for key in ("sk-flag-0001", *FILE_KEYS, *ENV_KEYS):
        assert key not in shown


def test_match_compares_with_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a) + len(b))
        return compare(a, b)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", counting)
    keys = APIKeys(ENV_KEYS)
    assert keys.match(ENV_KEYS[0]) == 0  # a hit on the first key still compares all three
    assert keys.match("short") is None  # digests: the same length whatever is sent
    assert calls == [64] * 6


def test_world_readable_key_file_warns(tmp_path: Path) -> None:
    path = key_file(tmp_path, FILE_KEYS[0])
    path.chmod(0o644)
    (warning,) = load_api_keys(file=path, environ={}).warnings
    assert "readable by other users" in warning and FILE_KEYS[0] not in warning


SECRET = "sk-do-not-echo-0001"
BAD_FILES = {"empty file": "", "comments only": "# nothing yet\n\n",
             "inline comment": f"# ok\n{SECRET} # team a\n", "key with a space": f"{SECRET} x\n"}
BAD_ENV = {"empty env": "", "separators env": " , \n", "non-ascii env": f"{SECRET},sk-caf\u00e9"}


def unusable_source(tmp_path: Path, case: str) -> tuple[list[str], dict[str, str]]:
    """(serve arguments, environment) for one kind of unusable key source."""
    if case in BAD_FILES:
        return ["--api-key-file", str(key_file(tmp_path, BAD_FILES[case]))], {}
    if case in BAD_ENV:
        return [], {ENV: BAD_ENV[case]}
    return {"missing file": ["--api-key-file", str(tmp_path / "absent")],
            "directory": ["--api-key-file", str(tmp_path)],
            "empty flag": ["--api-key", " "]}[case], {}


@pytest.mark.parametrize("case, needle", [
    ("empty file", "holds no key"),
    ("comments only", "holds no key"),
    ("missing file", "cannot read it"),
    ("directory", "cannot read it"),
    ("inline comment", "line 2 is not a valid API key"),
    ("key with a space", "line 1 is not a valid API key"),
    ("empty env", "$SLOTSERVE_API_KEY is set but holds no key"),
    ("separators env", "$SLOTSERVE_API_KEY is set but holds no key"),
    ("non-ascii env", "$SLOTSERVE_API_KEY: key 2 is not a valid API key"),
    ("empty flag", "--api-key is empty"),
])
def test_unusable_source_is_a_startup_error(tmp_path: Path, case: str, needle: str,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv, env = unusable_source(tmp_path, case)
    args = build_parser().parse_args(["serve", "--port", "1", *argv])
    with pytest.raises(APIKeyError) as info:
        load_api_keys(args.api_key, args.api_key_file, env)
    message = str(info.value)
    assert needle in message and SECRET not in message
    # the CLI entry: exit 2 with that message, before any banner or model load
    monkeypatch.delenv(ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert serve_main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"slotserve serve: error: {message}\n"


def test_create_app_takes_several_keys() -> None:
    app = create_app(EngineConfig(), api_key=list(FILE_KEYS), model_id="m")

    async def run() -> None:
        client = app.test_client()
        for key in FILE_KEYS:
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
            r = await client.post("/v1/messages", json={"max_tokens": 1, "messages": FRANCE},
                                  headers={"x-api-key": key})
            assert r.status_code == 503  # past auth; nothing loaded
        r = await client.get("/v1/models", headers={"Authorization": f"Bearer {WRONG}"})
        assert r.status_code == 401 and WRONG not in (await r.get_data(as_text=True))

    asyncio.run(run())


# ---- a real `slotserve serve` --------------------------------------------------------------


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    stdout: Path
    stderr: Path

    def output(self) -> tuple[str, str]:
        return self.stdout.read_text(), self.stderr.read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slotserve_command() -> list[str]:
    script = Path(sys.executable).with_name("slotserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "slotserve.cli"]


@contextmanager
def serve_cli(tmp_path: Path, *args: str, env_keys: str | None = None) -> Iterator[Served]:
    """`slotserve serve ARGS`, logging requests as JSON, until healthy; SIGTERM it on exit."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_keys is not None:
        env[ENV] = env_keys
    port = free_port()
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen([*slotserve_command(), "--log-format", "json",
                                 "--log-level", "info", "serve",
                                 "--port", str(port), "--max-slots", "2", *args],
                                stdout=o, stderr=e, env=env)
    served = Served(proc, f"http://127.0.0.1:{port}", out, err)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"server exited {proc.returncode}: {served.output()}"
            assert time.monotonic() < deadline, f"server not ready: {served.output()}"
            try:
                if httpx.get(served.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_401(r: httpx.Response, sent: str | None = None) -> None:
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert "Authorization: Bearer <key>" in err["message"]
    assert sent is None or sent not in r.text


def cmdline(pid: int) -> bytes:
    path = Path(f"/proc/{pid}/cmdline")
    if not path.exists():
        pytest.skip("no /proc on this platform")
    return path.read_bytes()


def test_served_with_key_file_two_keys(tmp_path: Path) -> None:
    path = key_file(tmp_path, f"# two tenants\n{FILE_KEYS[0]}\n\n{FILE_KEYS[1]}\n")
    with serve_cli(tmp_path, "--api-key-file", str(path)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        argv = cmdline(srv.proc.pid)
        assert str(path).encode() in argv and b"--api-key-file" in argv
        assert not any(k.encode() in argv for k in FILE_KEYS)

        assert http.get("/health").status_code == 200  # open without a key
        assert_openai_401(http.get("/v1/models"))
        assert_openai_401(http.get("/v1/models", headers=bearer(WRONG)), WRONG)
        refused = http.post("/v1/chat/completions", headers=bearer(WRONG),
                            json={"messages": FRANCE, "max_tokens": 1})
        assert_openai_401(refused, WRONG)
        # refused before its body was read: the connection must not be reused
        assert refused.headers["Connection"] == "close"
        for key in FILE_KEYS:
            r = http.post("/v1/chat/completions", headers=bearer(key),
                          json={"messages": FRANCE, "max_tokens": 1})
            assert r.status_code == 200 and r.json()["object"] == "chat.completion"

        body = {"max_tokens": 1, "messages": FRANCE}
        r = http.post("/v1/messages", json=body, headers={"x-api-key": WRONG})
        assert r.status_code == 401 and WRONG not in r.text
        assert r.headers["Connection"] == "close"
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        r = http.post("/v1/messages", json=body, headers={"x-api-key": FILE_KEYS[1]})
        assert r.status_code == 200 and r.json()["type"] == "message"

    assert srv.proc.returncode == 0
    stdout, stderr = srv.output()
    assert f"auth: 2 API keys (2 from --api-key-file {path})" in stdout
    assert '"path": "/v1/models", "status": 401' in stderr  # request logs were on
    for secret in (*FILE_KEYS, WRONG):
        assert secret not in stdout and secret not in stderr


def test_served_with_env_var_only_requires_the_key(tmp_path: Path) -> None:
    with serve_cli(tmp_path, env_keys=f"{ENV_KEYS[0]},{ENV_KEYS[1]}\n{ENV_KEYS[2]}") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        assert not any(k.encode() in cmdline(srv.proc.pid) for k in ENV_KEYS)
        assert_openai_401(http.get("/v1/models"))
        assert_openai_401(http.get("/v1/models", headers=bearer(WRONG)), WRONG)
        for key in ENV_KEYS:
            assert http.get("/v1/models", headers=bearer(key)).status_code == 200
        r = http.post("/v1/chat/completions", headers=bearer(ENV_KEYS[2]),
                      json={"messages": FRANCE, "max_tokens": 1})
        assert r.status_code == 200
    stdout, stderr = srv.output()
    assert "auth: 3 API keys (3 from $SLOTSERVE_API_KEY)" in stdout
    for secret in (*ENV_KEYS, WRONG):
        assert secret not in stdout and secret not in stderr


def test_served_with_empty_key_file_exits_with_a_message(tmp_path: Path) -> None:
    path = key_file(tmp_path, "# keys go here\n\n")
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run([*slotserve_command(), "serve", "--port", str(free_port()),
                           "--api-key-file", str(path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2
    assert f"slotserve serve: error: --api-key-file {path}: holds no key" in done.stderr
    assert "slotserve serving" not in done.stdout  # never served without auth
