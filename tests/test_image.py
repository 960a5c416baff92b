"""The CPU image, built for real from the Dockerfile, serves from its own filesystem.

k8s/build-cpu-image.sh builds it with podman on a Debian base made by debootstrap, so no
image registry is needed. The image is then run the way the Deployment runs it, without a
container runtime: chroot into its mounted root (read-only, as readOnlyRootFilesystem has
it) with the image's own Env, User and WorkingDir, writable tmpfs on /tmp, $HOME and
/dev/shm (the pod's emptyDirs), and its ENTRYPOINT unchanged. Only the ports move to free
loopback ones, through PAGEDSERVE_* env vars as a pod's env would set them. The model is
the default one baked in at build time: the cache it lives in is read-only here, so a
server that needed to fetch it could not start.

Needs root, podman and debootstrap (.ci/run installs the last two), network to a Debian
mirror and to PyPI for the build, and several minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
TAG = "localhost/pagedserve:cpu-test"
BUILD_TIMEOUT_S = 1500
READY_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def run(*command: str, timeout: float = 60) -> str:
    return subprocess.run(
        command, check=True, capture_output=True, text=True, timeout=timeout
    ).stdout.strip()


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert match, f"no ARG {name}= in the Dockerfile"
    return match.group(1)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> dict:
    """The built image's config (podman image inspect's .Config)."""
    if os.geteuid() != 0:
        pytest.skip("building and mounting the image needs root")
    for binary in ("podman", "debootstrap", "chroot"):
        if shutil.which(binary) is None:
            pytest.skip(f"{binary} not installed (apt-get install podman debootstrap)")
    # torch for the image's Python (bookworm's 3.11), the build this test's own pip picks
    # (the CPU one where pip is set up for it), so the build need not fetch PyPI's CUDA build.
    wheels = tmp_path_factory.mktemp("wheels")
    torch = f"torch=={dockerfile_arg('TORCH_VERSION')}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
         "-d", str(wheels), torch],
        check=True, timeout=600,
    )  # fmt: skip
    env = {**os.environ, "TORCH_WHEELS": str(wheels)}
    # The build's pip trusts what this test's pip trusts (a proxy's CA, if pip is told of one).
    configured = run(sys.executable, "-m", "pip", "config", "list")
    in_file = re.search(r"^global\.cert='(.+)'$", configured, re.M)
    if ca := os.environ.get("PIP_CERT") or (in_file and in_file.group(1)):
        env["CA_BUNDLE"] = ca
    build = [str(ROOT / "k8s" / "build-cpu-image.sh"), TAG]
    subprocess.run(["bash", *build], check=True, timeout=BUILD_TIMEOUT_S, env=env)
    (inspected,) = json.loads(run("podman", "image", "inspect", TAG))
    return inspected["Config"]


@contextlib.contextmanager
def mounted_root(tag: str) -> Iterator[Path]:
    """The image's root filesystem, read-only, with what a container runtime adds to it."""
    root = Path(run("podman", "image", "mount", tag))
    done: list[Path] = []
    try:
        for source, target, options in (
            ("proc", "proc", ["-t", "proc"]),
            ("/sys", "sys", ["--bind", "-o", "ro"]),
            ("/dev", "dev", ["--bind"]),
            ("shm", "dev/shm", ["-t", "tmpfs", "-o", "mode=1777"]),
            ("tmp", "tmp", ["-t", "tmpfs", "-o", "mode=1777"]),
            ("home", "home/pagedserve", ["-t", "tmpfs", "-o", "uid=10001,gid=10001,mode=700"]),
        ):
            run("mount", *options, source, str(root / target))
            done.append(root / target)
        yield root
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-l", str(target)], check=False)
        subprocess.run(["podman", "image", "unmount", tag], check=False, capture_output=True)


@contextlib.contextmanager
def entrypoint(root: Path, config: dict) -> Iterator[tuple[ServerProcess, int]]:
    """The image's ENTRYPOINT started in `root` as the image's user; the process and its
    REST port. The process is killed on the way out if it is still running."""
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    env = [*config["Env"], "HOME=/home/pagedserve"]
    env += ["PAGEDSERVE_HOST=127.0.0.1", f"PAGEDSERVE_GRPC_PORT={grpc_port}"]
    env += ["PAGEDSERVE_HTTP_HOST=127.0.0.1", f"PAGEDSERVE_HTTP_PORT={http_port}"]
    env += ["PAGEDSERVE_METRICS_HOST=127.0.0.1", f"PAGEDSERVE_METRICS_PORT={metrics_port}"]
    # chroot execs env, env execs the entrypoint: one pid, the server's, gets the signals.
    command = ["chroot", f"--userspec={config['User']}", str(root), "/usr/bin/env", "-i"]
    command += [f"--chdir={config['WorkingDir']}", *env, *config["Entrypoint"]]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    server = ServerProcess(proc, grpc_port, metrics_port, log)
    try:
        yield server, http_port
    finally:
        server.stop()


def test_the_built_image_serves_generate_and_rest_as_its_user_and_drains_on_sigterm(image):
    assert image["Entrypoint"] == ["pagedserve", "serve"]
    assert image["User"] == "10001:10001"
    with mounted_root(TAG) as root:
        (model,) = (root / "opt/pagedserve/cache/models").glob("*.gguf")
        assert model.stat().st_uid == 10001
        with entrypoint(root, image) as (server, http_port):
            server.wait_ready(READY_TIMEOUT_S)
            status = Path(f"/proc/{server.proc.pid}/status").read_text()
            assert re.search(r"^Uid:\s+10001\s", status, re.M), status

            request = pb.GenerateRequest(
                text="The capital of France is",
                stopping=pb.StoppingOptions(max_tokens=8),
                sampling=pb.SamplingOptions(temperature=0.0),
            )
            with grpc.insecure_channel(server.target) as channel:
                response = inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60)
            (candidate,) = response.candidates
            assert candidate.text.strip() and not candidate.error
            assert 0 < response.usage.completion_tokens <= 8
            counted = server.metrics()['pagedserve_requests_total{code="OK",rpc="Generate"}']
            assert counted == 1

            health = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5)
            assert health.status == 200

            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(60) == 0, server.stderr()
