"""`kvmesh up` in the foreground: start the mesh (launcher.py), print where to send requests,
watch it until a stop signal, stop everything."""

from __future__ import annotations

from kvmesh.engine.loader.resolve import served_name
from kvmesh.mesh.launcher import Mesh, UpOptions, say
from kvmesh.processes import StopSignal, StopSignals


def run_up(options: UpOptions) -> int:
    signals = StopSignals()
    signals.install()  # first of all: from here on a signal stops whatever was started
    mesh = Mesh(options, signals=signals)
    try:
        say(
            f"kvmesh: starting etcd, 1 gateway, {options.prefill} prefill, {options.decode} "
            f"decode (logs in {mesh.run_dir}) ..."
        )
        mesh.start()
        print_ready(mesh, options)
        return mesh.wait()
    except StopSignal as stop:
        say(f"kvmesh: {stop} received, stopping everything ...")
        return 0
    finally:
        mesh.stop()
        say("kvmesh: stopped")
        signals.restore()


def print_ready(mesh: Mesh, options: UpOptions) -> None:
    assert mesh.etcd is not None
    url = mesh.url
    cacert = f"--cacert {mesh.tls.ca} " if mesh.tls else ""
    names = options.gateway.api.served_model_name
    name = names[0] if names else served_name(options.model)
    precision = f"\n  precision: {options.precision}" if options.precision else ""
    say(
        f"""kvmesh is up: model {options.model}{precision}
  REST (OpenAI): {url}/v1    gRPC Gateway: 127.0.0.1:{mesh.grpc_port}    etcd: {mesh.etcd.endpoint}
  try:
    curl -s {cacert}{url}/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
  Ctrl-C stops everything."""
    )
