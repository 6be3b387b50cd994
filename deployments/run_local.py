"""``make run``: serve the split app on this machine.

Starts a local Ray head offering both phase tags (unless a cluster is already reachable),
runs ``serve run`` on the config, waits until the app is ready, prints how to call it, and on
Ctrl-C stops what it started. The head keeps Ray's dashboard (``serve status``, ``serve
config`` and ``serve deploy`` talk to it) on 127.0.0.1 unless told otherwise, and exports
metrics for Prometheus on a fixed port.

    python -m deployments.run_local [--config serve_configs/local.yaml]
        [--dashboard-host 127.0.0.1] [--dashboard-port 8265] [--metrics-export-port 8080]
        [--direct-ingress-port 30000]

``--direct-ingress-port`` starts the head with Serve's direct ingress: the ingress replica
serves HTTP itself on that port (the serve config's ``http_options.host``), so a streamed
token skips the hop through Serve's proxy (which still answers on ``http_options.port``).
It is Serve's cluster-wide mode, read when Ray starts, so it needs the head this starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from deployments.args import AppArgs

ROOT = Path(__file__).resolve().parent.parent


def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def _cluster_reachable() -> bool:
    if os.environ.get("RAY_ADDRESS"):
        return True
    result = subprocess.run([_bin("ray"), "status"], capture_output=True, text=True)
    return result.returncode == 0


def _dashboard_flags(host: str, port: int) -> list[str]:
    """Ray's dashboard where its dependencies (ray[default], which ray[serve] includes) are
    installed; without them ``ray start --include-dashboard=true`` fails, so say what is lost."""
    import ray._private.utils

    error = ray._private.utils.get_dashboard_dependency_error()
    if error is not None:
        print(f"Ray's dashboard needs ray[default] ({error}); starting without it: serve "
              "status / config / deploy will not work", file=sys.stderr, flush=True)
        return ["--include-dashboard=false"]
    return ["--include-dashboard=true", f"--dashboard-host={host}", f"--dashboard-port={port}"]


def direct_ingress_env(port: int) -> dict[str, str]:
    """What ``ray start`` needs in its environment for Serve's direct ingress with the
    ingress replicas' HTTP ports from ``port`` on (one per replica on a node; 16 of room)."""
    if not 0 < port <= 65535 - 15:
        raise ValueError(f"direct ingress port must be in 1..{65535 - 15}, got {port}")
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 15)}


def _phase_tags(config: dict) -> dict[str, float]:
    tags: dict[str, float] = {}
    for app in config.get("applications", []):
        args = AppArgs.model_validate(app.get("args") or {})
        for phase in args.phases:
            tag = args.phase(phase).resource_tag
            if tag:
                tags[tag] = tags.get(tag, 0) + 2  # room for a second replica of each phase
    return tags or {"prefill_accel": 2, "decode_accel": 2}


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if json.loads(resp.read()).get("ready"):
                    return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def _banner(url: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 64})
    return f"""
splitserve is ready at {url}

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', \\
messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

Ctrl-C stops it.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "serve_configs" / "local.yaml"))
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--dashboard-host", default=os.environ.get(
        "SPLITSERVE_DASHBOARD_HOST", "127.0.0.1"), help="where the head's Ray dashboard "
        "listens (0.0.0.0 exposes a port that runs code for anyone who reaches it)")
    parser.add_argument("--dashboard-port", type=int, default=8265)
    parser.add_argument("--metrics-export-port", type=int, default=8080,
                        help="the head's Prometheus endpoint (http://HOST:PORT/metrics)")
    parser.add_argument("--direct-ingress-port", type=int, default=int(os.environ.get(
        "SPLITSERVE_DIRECT_INGRESS_PORT", "0")), help="0: off; else Serve's direct "
        "ingress, the ingress replica serving HTTP on this port (no proxy hop)")
    args = parser.parse_args(argv)
    head_env = direct_ingress_env(args.direct_ingress_port) if args.direct_ingress_port else {}
    config = yaml.safe_load(Path(args.config).read_text())
    http = config.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{http.get('port', 8000)}"
    model = AppArgs.model_validate(
        (config.get("applications") or [{}])[0].get("args") or {}).model_name

    started_ray = False
    if _cluster_reachable():
        if head_env:
            print("a Ray cluster is already running: direct ingress is set when Ray starts, "
                  "so stop it first (ray stop) or leave out --direct-ingress-port",
                  file=sys.stderr)
            return 2
    else:
        tags = json.dumps(_phase_tags(config))
        cpus = str(max(4, os.cpu_count() or 1))
        print(f"starting a local Ray head with resources {tags}", flush=True)
        subprocess.run([_bin("ray"), "start", "--head", f"--resources={tags}",
                        f"--num-cpus={cpus}", f"--metrics-export-port={args.metrics_export_port}",
                        *_dashboard_flags(args.dashboard_host, args.dashboard_port),
                        "--disable-usage-stats"], check=True, env=dict(os.environ, **head_env))
        started_ray = True
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    serve_proc = subprocess.Popen([_bin("serve"), "run", args.config], cwd=ROOT, env=env)
    try:
        if _wait_ready(url, serve_proc, args.ready_timeout):
            if head_env:
                url = f"{url.rsplit(':', 1)[0]}:{args.direct_ingress_port}"
            print(_banner(url, model), flush=True)
            if started_ray:
                print(f"Ray dashboard: http://{args.dashboard_host}:{args.dashboard_port} "
                      f"(serve status); metrics: http://127.0.0.1:{args.metrics_export_port}"
                      "/metrics", flush=True)
        else:
            print("the app did not become ready; see the log above", file=sys.stderr)
        return serve_proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if serve_proc.poll() is None:
            serve_proc.send_signal(signal.SIGINT)
            try:
                serve_proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve_proc.kill()
        if started_ray:
            subprocess.run([_bin("ray"), "stop"], check=False)


if __name__ == "__main__":
    sys.exit(main())
