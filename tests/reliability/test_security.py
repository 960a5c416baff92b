"""Security: TLS and mTLS on both ports, the API key over TLS, request
content kept out of the logs, and request ids one caller cannot use against another.

Real servers on loopback over a tiny random model; a throwaway CA, server and client
certificates are made per module (tests/tls_certs.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import ssl

import grpc
import httpx2 as httpx  # the HTTP client the openai package (3.x) is built on
import openai
import pytest
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import AsyncInferenceClient
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.cli import main
from service.config import ServerConfig
from service.grpc.handlers import SERVICE_NAME
from service.settings import SETTINGS, ConfigError, resolve_settings
from tests.test_grpc_server import greedy, kv_back_to_zero, serving
from tests.tiny_models import write_tiny_model
from tests.tls_certs import Pki, write_pki

KEY = "test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("security-tiny"), "llama")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


def tls_config(pki: Pki, mutual: bool, **fields) -> ServerConfig:
    return ServerConfig(
        grpc_port=0,
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(pki.ca) if mutual else None,
        **fields,
    )


def credentials(pki: Pki, who: str | None = None, ca=None) -> grpc.ChannelCredentials:
    """Channel credentials trusting `ca` (default: the test CA), with `who`'s certificate."""
    cert = key = None
    if who is not None:
        cert = getattr(pki, f"{who}_cert").read_bytes()
        key = getattr(pki, f"{who}_key").read_bytes()
    return grpc.ssl_channel_credentials((ca or pki.ca).read_bytes(), key, cert)


def https_context(pki: Pki, who: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if who is not None:
        context.load_cert_chain(getattr(pki, f"{who}_cert"), getattr(pki, f"{who}_key"))
    return context


async def refused(call) -> grpc.StatusCode:
    """The status a call that should not get through ends with (its handshake failed)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


# ---- startup: clear errors for bad TLS files -------------------------------------------------


def resolve(env: dict[str, str]) -> ServerConfig:
    return resolve_settings(argparse.Namespace(), env).server_config()


def tls_env(pki: Pki, **files) -> dict[str, str]:
    values = {"cert": str(pki.server_cert), "key": str(pki.server_key)} | files
    names = {"cert": "TLS_CERT_FILE", "key": "TLS_KEY_FILE", "ca": "TLS_CLIENT_CA_FILE"}
    return {f"PAGEDSERVE_{names[k]}": v for k, v in values.items() if v is not None}


def test_bad_tls_files_stop_startup_naming_the_setting(pki, tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    cases = [  # (env, what the one-line error must say)
        (tls_env(pki, cert=str(tmp_path / "nope.pem")), r"TLS_CERT_FILE: cannot read .*nope.pem"),
        (tls_env(pki, key=str(tmp_path)), r"TLS_KEY_FILE: cannot read .*: Is a directory"),
        (tls_env(pki, cert=str(garbage)), r"TLS_CERT_FILE: .*garbage.pem is not a PEM file"),
        (tls_env(pki, key=str(pki.other_key)), r"TLS_KEY_FILE: .* is not the key of the cert"),
        (tls_env(pki, key=str(encrypted)), r"TLS_KEY_FILE: .*encrypted.key is encrypted"),
        (tls_env(pki, key=str(pki.server_cert)), r"TLS_CERT_FILE: .*not a certificate and its"),
        (tls_env(pki, ca=str(garbage)), r"TLS_CLIENT_CA_FILE: .*garbage.pem is not a PEM file"),
        (tls_env(pki, ca=str(pki.server_key)), r"TLS_CLIENT_CA_FILE: .*no CA certificate in it"),
        (tls_env(pki, key=None), r"^tls_key_file: must be set too"),
        (tls_env(pki, cert=None), r"^tls_cert_file: must be set too"),
        (tls_env(pki, cert=None, key=None, ca=str(pki.ca)), r"TLS_CLIENT_CA_FILE: needs tls_cert"),
    ]
    for env, expected in cases:
        with pytest.raises(ConfigError) as err:
            resolve(env)
        assert re.search(expected, str(err.value)), (env, str(err.value))
    assert resolve(tls_env(pki, ca=str(pki.ca))).tls.mutual  # the good files are fine


def test_serve_exits_2_on_a_mismatched_key(pki, capsys, monkeypatch):
    for s in SETTINGS:
        monkeypatch.delenv(s.env, raising=False)
    argv = ["serve", "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.bob_key)]
    assert main(argv) == 2  # before any model is loaded
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pagedserve: error: argument --tls-key-file: ")
    assert "is not the key of the certificate" in line


# ---- TLS and mTLS on the gRPC port -----------------------------------------------------------


async def test_grpc_over_tls_with_the_api_key(tiny_model, pki):
    async with serving(tiny_model, tls_config(pki, mutual=False, api_key=KEY)) as (srv, _, _):
        target = f"localhost:{srv.port}"
        async with grpc.aio.secure_channel(target, credentials(pki)) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            response = await stub.Generate(
                pb.GenerateRequest(text="hi", **greedy(4)), metadata=AUTH
            )
            assert response.usage.completion_tokens == 4
            # TLS does not replace the key: without it, still UNAUTHENTICATED
            no_key = stub.Generate(pb.GenerateRequest(text="hi", **greedy(4)))
            assert await refused(no_key) == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel)  # health over TLS, no key needed
            status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(target) as plain:  # plaintext client: refused
            call = inference_pb2_grpc.InferenceStub(plain).GetModelInfo(
                pb.GetModelInfoRequest(), metadata=AUTH, timeout=5
            )
            assert await refused(call) == grpc.StatusCode.UNAVAILABLE
        wrong_ca = credentials(pki, ca=pki.stranger_cert)  # does not trust the server
        async with grpc.aio.secure_channel(target, wrong_ca) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(), metadata=AUTH, timeout=5
            )
            assert await refused(call) == grpc.StatusCode.UNAVAILABLE
        # the client library, with the CA file
        async with AsyncInferenceClient(target, api_key=KEY, ca_file=str(pki.ca)) as client:
            assert (await client.model_info()).name == "tiny"


async def test_grpc_mtls_wants_a_client_certificate_from_the_ca(tiny_model, pki):
    config = tls_config(pki, mutual=True, health_port=0)
    async with serving(tiny_model, config) as (srv, _, _):
        target = f"localhost:{srv.port}"
        for who in (None, "stranger"):  # no certificate; one from another CA
            async with grpc.aio.secure_channel(target, credentials(pki, who)) as channel:
                call = inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
                    pb.GetModelInfoRequest(), timeout=5
                )
                assert await refused(call) == grpc.StatusCode.UNAVAILABLE, who
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert await refused(health) == grpc.StatusCode.UNAVAILABLE, who
        async with grpc.aio.secure_channel(target, credentials(pki, "alice")) as channel:
            info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
                pb.GetModelInfoRequest()
            )
            assert info.name == "tiny"
        client = AsyncInferenceClient(
            target, ca_file=str(pki.ca), cert_file=str(pki.alice_cert), key_file=str(pki.alice_key)
        )
        async with client:
            assert await client.tokenize("hello")
        # Probes that cannot do TLS use the plaintext health port: health and nothing else.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.health_port}") as plain:
            health = health_pb2_grpc.HealthStub(plain)
            for name in ("", SERVICE_NAME):
                status = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert status.status == health_pb2.HealthCheckResponse.SERVING
            call = inference_pb2_grpc.InferenceStub(plain).GetModelInfo(pb.GetModelInfoRequest())
            assert await refused(call) == grpc.StatusCode.UNIMPLEMENTED
        await srv.drain(0)  # one health status, two doors: readiness falls on both
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.health_port}") as plain:
            status = await health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            )
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_cli_client_over_mtls(tiny_model, pki, capsys):
    async with serving(tiny_model, tls_config(pki, mutual=True)) as (srv, _, _):
        argv = ["client", "generate", "--target", f"localhost:{srv.port}", "--prompt", "hi"]
        argv += ["--max-tokens", "3", "--ca-file", str(pki.ca)]
        assert await asyncio.to_thread(main, argv) == 1  # no client certificate: refused
        assert "UNAVAILABLE" in capsys.readouterr().err
        argv += ["--cert-file", str(pki.bob_cert), "--key-file", str(pki.bob_key), "--json"]
        assert await asyncio.to_thread(main, argv) == 0
        assert '"completionTokens": 3' in capsys.readouterr().out
        assert await asyncio.to_thread(main, argv[:-3]) == 2  # a certificate without its key
        assert "cert_file and key_file go together" in capsys.readouterr().err


# ---- HTTPS and mTLS on the REST shim, with the official openai client ------------------------


async def test_rest_over_https_with_the_api_key(tiny_model, pki):
    config = tls_config(pki, mutual=False, http_port=0, api_key=KEY)
    async with serving(tiny_model, config) as (srv, _, _):
        base = f"https://localhost:{srv.http_port}"
        async with httpx.AsyncClient(verify=https_context(pki)) as http:
            client = openai.AsyncOpenAI(
                base_url=f"{base}/v1", api_key=KEY, http_client=http, max_retries=0
            )
            result = await client.completions.create(
                model="tiny", prompt="hello", max_tokens=4, temperature=0.0
            )
            assert result.usage.completion_tokens == 4
            chat = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert chat.usage.completion_tokens == 3
            wrong = openai.AsyncOpenAI(
                base_url=f"{base}/v1", api_key="wrong", http_client=http, max_retries=0
            )
            with pytest.raises(openai.AuthenticationError):  # TLS and the key, both
                await wrong.models.list()
            assert (await http.get(f"{base}/health")).status_code == 200
        async with httpx.AsyncClient() as http:  # the system CAs do not know ours
            with pytest.raises(httpx.ConnectError):
                await http.get(f"{base}/health")
            with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
                await http.get(f"http://127.0.0.1:{srv.http_port}/health")


async def test_rest_mtls_wants_a_client_certificate(tiny_model, pki):
    config = tls_config(pki, mutual=True, http_port=0)
    async with serving(tiny_model, config) as (srv, _, engine):
        base = f"https://localhost:{srv.http_port}"
        for who in (None, "stranger"):
            async with httpx.AsyncClient(verify=https_context(pki, who)) as http:
                client = openai.AsyncOpenAI(
                    base_url=f"{base}/v1", api_key="none", http_client=http, max_retries=0
                )
                with pytest.raises(openai.APIConnectionError):
                    await client.models.list()
        async with httpx.AsyncClient(verify=https_context(pki, "alice")) as http:
            client = openai.AsyncOpenAI(
                base_url=f"{base}/v1", api_key="none", http_client=http, max_retries=0
            )
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].usage.completion_tokens == 5
        await kv_back_to_zero(engine)


# ---- request ids: no caller reaches another's request ----------------------------------------


async def read_all(call) -> tuple[str, list[str], int, int]:
    """A stream's text, the request ids its messages carried, finish reason and tokens."""
    text, ids, reason, tokens = "", [], 0, 0
    while (message := await call.read()) is not grpc.aio.EOF:  # read(): callers may too
        text += message.text
        ids.append(message.request_id)
        tokens += len(message.token_ids)
        reason = message.finish_reason or reason
    return text, ids, reason, tokens


async def test_request_ids_are_scoped_per_client_certificate(tiny_model, pki):
    async with serving(tiny_model, tls_config(pki, mutual=True)) as (srv, core, engine):
        target = f"localhost:{srv.port}"
        async with (
            grpc.aio.secure_channel(target, credentials(pki, "alice")) as a_channel,
            grpc.aio.secure_channel(target, credentials(pki, "bob")) as b_channel,
        ):
            alice = inference_pb2_grpc.InferenceStub(a_channel)
            bob = inference_pb2_grpc.InferenceStub(b_channel)
            request = pb.GenerateRequest(request_id="job-1", text="abc", **greedy(200))
            alices = alice.StreamGenerate(request)
            first = await alices.read()
            assert first.request_id == "job-1"  # the caller's id, never the engine's
            (alice_id,) = [r for r in list(core.requests) if r.startswith("job-1")]
            assert alice_id != "job-1"  # the engine's id is scoped by her certificate
            # Bob uses the same id: he can neither cancel Alice's request...
            assert not (await bob.Cancel(pb.CancelRequest(request_id="job-1"))).cancelled
            # ...nor is refused or attached to it: "job-1" is his own request, with his output
            bobs = await bob.Generate(
                pb.GenerateRequest(request_id="job-1", text="xyz", **greedy(3))
            )
            assert bobs.request_id == "job-1"
            assert bobs.usage.completion_tokens == 3
            assert bobs.usage.prompt_tokens == len(core.tokenizer.encode("xyz"))
            assert engine.is_running(alice_id)  # all that happened while hers ran
            text, ids, reason, tokens = await read_all(alices)
            assert reason == pb.FINISH_REASON_LENGTH  # Alice's ran to its end
            assert tokens + len(first.token_ids) == 200
            assert set(ids) == {"job-1"}
            # Alice cancels her own by the same id
            again = alice.StreamGenerate(
                pb.GenerateRequest(request_id="job-1", text="abc", **greedy(200))
            )
            await again.read()
            assert (await alice.Cancel(pb.CancelRequest(request_id="job-1"))).cancelled
            assert (await read_all(again))[2] == pb.FINISH_REASON_CANCELLED
        await kv_back_to_zero(engine)


async def test_request_ids_without_client_certificates(tiny_model):
    """Without mTLS every caller is one principal: a colliding id is refused (never
    attached to the running request), and ids the server makes are unguessable."""
    async with serving(tiny_model) as (srv, _, engine):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            live = stub.StreamGenerate(pb.GenerateRequest(request_id="x", text="a", **greedy(60)))
            await live.read()
            duplicate = stub.StreamGenerate(
                pb.GenerateRequest(request_id="x", text="b", **greedy(60))
            )
            assert await refused(read_all(duplicate)) == grpc.StatusCode.ALREADY_EXISTS
            assert (await read_all(live))[2] == pb.FINISH_REASON_LENGTH
            made = [
                (await stub.Generate(pb.GenerateRequest(text="a", **greedy(1)))).request_id
                for _ in range(3)
            ]
            assert len(set(made)) == 3
            assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in made)  # uuid4: 122 random bits
        await kv_back_to_zero(engine)


async def rpc_error(call) -> grpc.aio.AioRpcError:
    """The error a unary call, or a stream read to its end, fails with."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await (read_all(call) if isinstance(call, grpc.aio.UnaryStreamCall) else call)
    return err.value


# Too long, a 1 MB one (it would be repeated in every stream message), and characters
# outside visible ASCII: a space, a newline (a forged log line), a NUL, a non-ASCII letter.
BAD_REQUEST_IDS = ["r" * 129, "x" * 1_000_000, "job 1", "job\n1", "\x00", "jöb"]


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
async def test_request_ids_are_bounded_and_a_live_one_is_already_exists(tiny_model, engine_process):
    """An id of 1 to 128 visible ASCII characters is taken and carried by every message;
    any other is INVALID_ARGUMENT naming request_id (Generate, StreamGenerate and Cancel
    alike) in a message that does not quote it. A live id used again is ALREADY_EXISTS,
    with the engine on a thread or in its own process (the refusal's type crosses it), and
    the live request runs on untouched."""
    async with serving(tiny_model, engine_process=engine_process) as (srv, _, engine):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            longest = "~" + "r" * 126 + "!"
            live = stub.StreamGenerate(
                pb.GenerateRequest(request_id=longest, text="a", **greedy(60))
            )
            first = await live.read()
            assert first.request_id == longest
            for call in (stub.Generate, stub.StreamGenerate):
                again = call(pb.GenerateRequest(request_id=longest, text="b", **greedy(2)))
                err = await rpc_error(again)
                assert err.code() == grpc.StatusCode.ALREADY_EXISTS, err.details()
                assert err.details().startswith(f"request_id: {longest!r} is already running")
            for bad in BAD_REQUEST_IDS:
                request = pb.GenerateRequest(request_id=bad, text="c", **greedy(2))
                calls = [stub.Generate(request), stub.StreamGenerate(request)]
                for call in [*calls, stub.Cancel(pb.CancelRequest(request_id=bad))]:
                    err = await rpc_error(call)
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad[:9], err.details())
                    assert err.details().startswith("request_id: "), err.details()
                    assert len(err.details()) < 80, err.details()  # the id is not quoted
            err = await rpc_error(stub.Cancel(pb.CancelRequest()))
            assert (err.code(), err.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id: must not be empty",
            )
            text, ids, reason, tokens = await read_all(live)
            assert reason == pb.FINISH_REASON_LENGTH and tokens + len(first.token_ids) == 60
            assert set(ids) == {longest}
        await kv_back_to_zero(engine)


async def test_error_messages_quote_no_more_than_a_bounded_part_of_a_string(tiny_model):
    """A 1 MB model name or tool_function gets its own status and a short message (one
    quoting it whole overflowed gRPC's metadata limit: the caller saw RESOURCE_EXHAUSTED)."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    cases = [  # (request, code, start of the message)
        (dict(text="x", model="m" * 1_000_000), grpc.StatusCode.NOT_FOUND, "model: 'mmm"),
        (
            dict(
                chat=chat,
                tools=[pb.Tool(name="f")],
                tool_choice=pb.TOOL_CHOICE_FUNCTION,
                tool_function="g" * 1_000_000,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tool_function: ",
        ),
    ]
    async with serving(tiny_model) as (srv, _, engine):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for fields, code, start in cases:
                err = await rpc_error(stub.Generate(pb.GenerateRequest(**fields, **greedy(2))))
                assert err.code() == code, err.details()[:200]
                assert err.details().startswith(start) and len(err.details()) < 200
        await kv_back_to_zero(engine)


# ---- one API key rule for both doors ---------------------------------------------------------


async def test_more_than_one_authorization_value_is_refused_by_both_doors(tiny_model):
    """With two authorization values, whichever order and whether either is right, both
    doors refuse (gRPC UNAUTHENTICATED, REST 401) saying exactly one is allowed; the
    refusals are counted, and one right value still gets through both."""
    right, wrong = f"Bearer {KEY}", "Bearer wrong"
    pairs = [(right, wrong), (wrong, right), (right, right)]
    message = "authorization: exactly one value is allowed, got 2"
    config = ServerConfig(grpc_port=0, http_port=0, api_key=KEY)
    async with serving(tiny_model, config) as (srv, _, engine):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(text="hi", **greedy(2))
            for values in pairs:
                metadata = tuple(("authorization", v) for v in values)
                for call in (stub.Generate, stub.StreamGenerate):
                    err = await rpc_error(call(request, metadata=metadata))
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, values
                    assert err.details() == message
            assert (await stub.Generate(request, metadata=AUTH)).usage.completion_tokens == 2
        url = f"http://127.0.0.1:{srv.http_port}/v1/completions"
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        async with httpx.AsyncClient() as http:
            for values in pairs:
                headers = [("Authorization", v) for v in values]
                answer = await http.post(url, json=body, headers=headers)
                assert answer.status_code == 401, values
                assert answer.json()["error"]["message"] == message
            answer = await http.post(url, json=body, headers={"Authorization": right})
            assert answer.status_code == 200
        registry = srv.door.metrics.registry
        for rpc, refused_calls in (("Generate", 3), ("StreamGenerate", 3), ("/v1/completions", 3)):
            labels = {"rpc": rpc, "code": "UNAUTHENTICATED"}
            assert registry.get_sample_value("pagedserve_requests_total", labels) == refused_calls
        await kv_back_to_zero(engine)


# ---- prompts and outputs stay out of the logs unless asked for -------------------------------

PROMPT = "zebra quokka 7391 marmalade"  # a marker no log line has otherwise
SAMPLED = dict(  # seeded sampling: outputs varied enough to be telling in a log
    sampling=pb.SamplingOptions(temperature=1.0, seed=11),
    stopping=pb.StoppingOptions(max_tokens=16, ignore_eos=True),
)
REST_SAMPLED = dict(model="tiny", temperature=1.0, seed=11, extra_body={"ignore_eos": True})
CLIENT_LOGGERS = ("openai", "httpx2", "httpcore2")  # the test's own clients, not the server


async def exchange(srv) -> list[str]:
    """One request of each kind with PROMPT (and two invalid ones); the output texts."""
    outputs = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        response = await stub.Generate(pb.GenerateRequest(text=PROMPT, **SAMPLED))
        outputs.append(response.candidates[0].text)
        stream = stub.StreamGenerate(pb.GenerateRequest(text=PROMPT + " stream", **SAMPLED))
        outputs.append((await read_all(stream))[0])
        bad = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(top_p=1.5))
        assert await refused(stub.Generate(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="none", max_retries=0
    )
    async with client:
        result = await client.completions.create(prompt=PROMPT, max_tokens=16, **REST_SAMPLED)
        outputs.append(result.choices[0].text)
        messages = [{"role": "user", "content": PROMPT}]
        chat = await client.chat.completions.create(
            messages=messages, max_tokens=16, **REST_SAMPLED
        )
        outputs.append(chat.choices[0].message.content)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert all(len(text) >= 8 for text in outputs), outputs  # long enough to be telling
    return outputs


@pytest.mark.parametrize("log_requests", [False, True])
async def test_request_content_reaches_the_log_only_when_asked(
    tiny_model, caplog, capfd, log_requests
):
    caplog.set_level(logging.DEBUG)  # every logger, the most verbose level
    config = ServerConfig(grpc_port=0, http_port=0, log_requests=log_requests)
    try:
        async with serving(tiny_model, config) as (srv, _, _):
            outputs = await exchange(srv)
    finally:
        logging.getLogger("service.requests").setLevel(logging.NOTSET)
    captured = capfd.readouterr()
    server_records = [r for r in caplog.records if not r.name.startswith(CLIENT_LOGGERS)]
    assert server_records  # the server did log, at DEBUG, meanwhile
    formatter = logging.Formatter()
    logged = "\n".join(formatter.format(r) for r in server_records)
    logged += captured.out + captured.err  # uvicorn's own handlers and gRPC's C core write there
    if not log_requests:
        assert PROMPT not in logged
        for text in outputs:
            assert text not in logged and repr(text) not in logged
    else:
        assert PROMPT in logged and PROMPT + " stream" in logged
        for text in outputs:  # one line per record: %r escapes newlines
            assert repr(text) in logged, text
