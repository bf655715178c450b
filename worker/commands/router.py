"""`tandem router`: the OpenAI-compatible front door (what the router pod runs)."""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path

import click

from tandem.worker.commands.control import control_options, resolve
from tandem.worker.router.auth import ApiKeys
from tandem.worker.router.canary import DEFAULT_INTERVAL_S as DEFAULT_CANARY_INTERVAL_S
from tandem.worker.router.discovery import Discovery, FileDiscovery, KubernetesDiscovery, StaticDiscovery
from tandem.worker.router.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_QUEUE_TIMEOUT_S,
)
from tandem.worker.router.placement import DEFAULT_BALANCE, DEFAULT_PLACEMENT, PLACEMENTS


@click.command("router")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--model-name", default=None, help="Model name clients ask for (default: what the workers serve).")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Model folder to read the tokenizer from (default: fetched from a worker).")
@click.option("--workers-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="YAML/JSON list of worker URLs (or {prefill: [...], decode: [...]}); re-read as it changes.")
@click.option("--prefill", multiple=True, help="Prefill worker URL (repeatable).")
@click.option("--decode", multiple=True, help="Decode (or both-role) worker URL (repeatable).")
@click.option("--discovery", type=click.Choice(["static", "k8s", "dns"]), default="static", show_default=True)
@click.option("--namespace", default="default", show_default=True)
@click.option("--prefill-service", default=None, help="Headless Service of the prefill pool (k8s/dns discovery).")
@click.option("--decode-service", default=None, help="Headless Service of the decode pool (k8s/dns discovery).")
@click.option("--worker-port", type=int, default=8000, show_default=True, help="Worker HTTP port (k8s/dns discovery).")
@click.option("--request-timeout", type=float, default=600.0, show_default=True,
              help="Per-request deadline in seconds.")
@click.option("--stall-timeout", type=float, default=60.0, show_default=True,
              help="A worker silent for this long mid-stream counts as lost (the request migrates).")
@click.option("--max-request-bytes", type=click.IntRange(min=1024), default=32 << 20, show_default=True,
              help="Largest request body accepted; a bigger one gets 413 before it is read or tokenized.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A Jinja file that replaces the model's chat template.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM: stop accepting connections and let open requests and streams finish for up to "
              "this many seconds.")
@click.option("--api-key", "api_keys", multiple=True, envvar="TANDEM_API_KEY",
              help="A key clients must send as `Authorization: Bearer KEY` on every route but /health, /ready, "
              "/metrics (repeatable: all are valid, for rotation). Also from $TANDEM_API_KEY (keys separated by "
              "spaces), which keeps them out of the process list.")
@click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path), envvar="TANDEM_API_KEY_FILE",
              default=None, help="A file of API keys, one a line (# comments); re-read when it changes.")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Serve HTTPS with this PEM certificate (chain); needs --ssl-keyfile.")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The PEM private key of --ssl-certfile.")
@click.option("--max-concurrent-requests", type=click.IntRange(min=1), default=DEFAULT_MAX_CONCURRENT_REQUESTS,
              show_default=True, help="Requests sent to the workers at once; more wait in the queue.")
@click.option("--max-queued-requests", type=click.IntRange(min=0), default=DEFAULT_MAX_QUEUED_REQUESTS,
              show_default=True, help="Requests admitted beyond the running ones (reading, tokenizing, waiting); "
              "past that a request gets 429 with Retry-After at once.")
@click.option("--queue-timeout", type=click.FloatRange(min=0), default=DEFAULT_QUEUE_TIMEOUT_S, show_default=True,
              help="Seconds a queued request waits for a running slot before it gets 429.")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=DEFAULT_HEADER_TIMEOUT_S, show_default=True,
              help="A request's line and headers must arrive within this many seconds, or 408 and the connection "
              "is closed.")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=DEFAULT_BODY_TIMEOUT_S, show_default=True,
              help="A request's whole body must arrive within this many seconds of its headers, or 408 and the "
              "connection is closed.")
@click.option("--canary-interval", type=click.FloatRange(min=0), default=DEFAULT_CANARY_INTERVAL_S, show_default=True,
              help="Seconds between output canary probes: one small greedy request prefilled locally and "
              "disaggregated on the same decode worker, which must give the same tokens "
              "(tandem_router_canary_probes_total); 0 turns it off.")
@click.option("--placement", type=click.Choice(PLACEMENTS), default=DEFAULT_PLACEMENT, show_default=True,
              help="How prefill workers are chosen: prefix = the worker holding the longest cached prefix of the "
              "prompt, against its queued tokens, within --placement-balance; first-block = the last worker that "
              "saw the prompt's first block; least-loaded; round-robin (docs/serving.md, Placement).")
@click.option("--placement-balance", type=click.FloatRange(min=1.0), default=DEFAULT_BALANCE, show_default=True,
              help="prefix placement: no prefill worker's recent prompt tokens above this times the mean.")
@click.option("--log-level", default="info", show_default=True)
@control_options
def command(host: str, port: int, model_name: str | None, model_dir: Path | None, workers_file: Path | None,
            prefill: tuple[str, ...], decode: tuple[str, ...], discovery: str, namespace: str,
            prefill_service: str | None, decode_service: str | None, worker_port: int, request_timeout: float,
            stall_timeout: float, max_request_bytes: int, chat_template: Path | None, drain_timeout: float,
            api_keys: tuple[str, ...], api_key_file: Path | None, ssl_certfile: Path | None,
            ssl_keyfile: Path | None, max_concurrent_requests: int, max_queued_requests: int, queue_timeout: float,
            header_timeout: float, body_timeout: float, canary_interval: float, placement: str,
            placement_balance: float, log_level: str,
            control_token_file: Path | None,
            insecure_control_api: bool) -> None:
    """Serve /v1/* by placing requests on prefill and decode workers."""
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s router:{port} %(levelname)s %(name)s: %(message)s")
    control = resolve(control_token_file, insecure_control_api)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    source: Discovery
    if discovery in ("k8s", "dns"):
        services = [s for s in (prefill_service, decode_service) if s]
        if not services:
            raise click.UsageError("--discovery k8s|dns needs --prefill-service and/or --decode-service")
        method = "dns" if discovery == "dns" else "endpointslices"
        if method == "endpointslices" and importlib.util.find_spec("kubernetes") is None:
            raise click.UsageError("--discovery k8s needs the kubernetes package (pip install 'tandem-serving[operator]'), "
                                   "or use --discovery dns")
        source = KubernetesDiscovery(namespace, services, worker_port, method)
    elif workers_file is not None:
        if prefill or decode:
            raise click.UsageError("give either --workers-file or --prefill/--decode URLs, not both")
        try:
            source = FileDiscovery(workers_file)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    elif prefill or decode:
        source = StaticDiscovery([*prefill, *decode])
    else:
        raise click.UsageError("no workers: give --workers-file, --prefill/--decode URLs, or --discovery k8s")
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise click.UsageError("--ssl-certfile and --ssl-keyfile go together")
    keys = _api_keys(api_keys, api_key_file)
    import uvicorn

    from tandem.worker.router.app import RouterConfig, create_app
    from tandem.worker.router.read_timeouts import ReadTimeoutProtocol

    cfg = RouterConfig(model_name=model_name, discovery=source, model_dir=model_dir,
                       request_timeout=request_timeout, stall_timeout=stall_timeout,
                       max_request_bytes=max_request_bytes, control=control,
                       chat_template=chat_template.read_text() if chat_template is not None else None,
                       api_keys=keys, max_concurrent_requests=max_concurrent_requests,
                       max_queued_requests=max_queued_requests, queue_timeout=queue_timeout,
                       canary_interval=canary_interval, placement=placement, placement_balance=placement_balance)
    logging.getLogger(__name__).info(
        "serving %s on %s:%d; API keys %s", "HTTPS" if ssl_certfile else "HTTP", host, port,
        "required" if keys.enabled else "off (anyone who reaches this port can use it)")
    # uvicorn's graceful shutdown is the drain: listeners close at once, open connections get this long.
    uvicorn.run(create_app(cfg), host=host, port=port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=math.ceil(drain_timeout),
                http=ReadTimeoutProtocol.with_timeouts(header_timeout, body_timeout),
                ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
                ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None)


def _api_keys(given: tuple[str, ...], file: Path | None) -> ApiKeys:
    keys = [k for value in given for k in value.split()]  # one --api-key "a b" is two keys, as in the variable
    try:
        return ApiKeys(keys, file)
    except (OSError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--api-key-file") from None
