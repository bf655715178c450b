"""`tandem worker`: one prefill, decode or both-role worker process (what a worker pod runs)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from tandem.worker import faults
from tandem.worker.commands.control import control_options, resolve
from tandem.worker.commands.vllm_flags import EPILOG, refuse_unsupported_vllm_flags
from tandem.worker.hardware import DTYPE_CHOICES, choose
from tandem.worker.server.config import KV_ENCRYPTIONS, WorkerConfig

log = logging.getLogger("tandem.worker")


@click.command("worker", epilog=EPILOG)
@click.option("--role", type=click.Choice(["prefill", "decode", "both"]), default="both", show_default=True)
@click.option("--model", "model_arg", required=True,
              help="Hugging Face style model folder, or a Hub model ORG/NAME[@REVISION] (or hf://NAME[@REVISION]) "
                   "downloaded into the Hub cache first (HF_TOKEN, HF_HUB_CACHE, HF_HUB_OFFLINE apply; a folder of "
                   "that name here wins).")
@click.option("--model-name", "--served-model-name", "model_name", default=None,
              help="Name served to clients (default: the folder name, or the Hub repository id).")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True,
              help="auto: float32 on CPU; on CUDA the model's config.json dtype (bfloat16 if it says float32).")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA when torch sees a GPU, else cpu), cpu or cuda[:N].")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--transport", type=click.Choice(["auto", "tcp", "rdma"]), default="auto", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--kv-port", type=int, default=5555, show_default=True, help="KV transfer port (decode role listens).")
@click.option("--kv-host", default=None, help="Address peers use for --kv-port (default: --host, or this host's IP).")
@click.option("--kv-keys", type=click.Path(file_okay=False, path_type=Path), envvar="TANDEM_KV_KEYS", default=None,
              help="Folder with the model's KV transfer keys (`tandem kv-keys`): encrypt and authenticate KV "
                   "transfers. Every worker of the model needs the same keys. [env: TANDEM_KV_KEYS]")
@click.option("--kv-encryption", type=click.Choice(KV_ENCRYPTIONS), default="auto", show_default=True,
              help="KV transfer encryption. aes-gcm: sessions authenticated with the control token, tcp payloads "
                   "AES-256-GCM; curve: --kv-keys; none: plain. auto: curve with --kv-keys, else aes-gcm with a "
                   "control token, else none. Every worker of the model needs the same.")
@click.option("--tensor-parallel", "--tensor-parallel-size", "-tp", "tensor_parallel", type=int, default=1,
              show_default=True, help="Ranks of this worker: one process each (one GPU each on CUDA, from --device on), "
                                      "in one pod. --role both only for now. See docs/tensor-parallel.md.")
@click.option("--max-model-len", type=int, default=None, help="Context limit (default: the model's).")
@click.option("--pool", default="local", show_default=True, help="Pool label on metrics (prefill|decode|local).")
@click.option("--layout-hash", envvar="TANDEM_LAYOUT_HASH", default=None,
              help="Expected KV layout hash; the worker refuses to start on a mismatch. [env: TANDEM_LAYOUT_HASH]")
@click.option("--kv-cache-bytes", type=int, default=None, help="KV cache budget (default: the engine's).")
@click.option("--gpu-memory-utilization", "memory_utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Share of the memory free at start (GPU memory, or RAM on CPU) for weights plus KV cache.")
@click.option("--seed", type=int, default=0, show_default=True, help="Default sampling seed.")
@click.option("--max-num-seqs", type=int, default=64, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=2048, show_default=True)
@click.option("--chunked-prefill/--no-chunked-prefill", default=True, show_default=True)
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True)
@click.option("--drain-timeout", type=float, default=60.0, show_default=True,
              help="Seconds in-flight requests get to finish after SIGTERM.")
@click.option(faults.FLAG, type=click.Choice(faults.FAULTS), default=None, hidden=True,
              help=f"Test hook: misbehave on purpose (refused unless {faults.ENV}=1).")
@click.option("--log-level", default="info", show_default=True)
@control_options
@refuse_unsupported_vllm_flags
def command(role: str, model_arg: str, model_name: str | None, dtype: str, device: str, block_size: int,
            transport: str, host: str, port: int, kv_port: int, kv_host: str | None, kv_keys: Path | None,
            kv_encryption: str, tensor_parallel: int,
            max_model_len: int | None, pool: str, layout_hash: str | None, kv_cache_bytes: int | None,
            memory_utilization: float | None, seed: int, max_num_seqs: int, max_num_batched_tokens: int,
            chunked_prefill: bool, prefix_caching: bool,
            drain_timeout: float, fault: str | None, log_level: str, control_token_file: Path | None,
            insecure_control_api: bool) -> None:
    """Run one worker: HTTP control API on --port, KV transfer on --kv-port."""
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s {role}:{port} %(levelname)s %(name)s: %(message)s")
    control = resolve(control_token_file, insecure_control_api)
    model_dir, hub_name = _model_folder(model_arg)
    model_name = model_name or hub_name
    try:
        choice = choose(device, dtype, model_dir)
        log.info("running on %s", choice.describe())
        cfg = WorkerConfig(
            model_dir=model_dir, model_name=model_name, role=role, pool=pool, dtype=choice.dtype, device=choice.device,
            block_size=block_size, transport=transport, host=host, port=port, kv_port=kv_port, kv_host=kv_host,
            tensor_parallel=tensor_parallel, max_model_len=max_model_len, layout_hash=layout_hash or None,
            kv_cache_bytes=kv_cache_bytes, memory_utilization=memory_utilization, seed=seed, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=chunked_prefill, enable_prefix_caching=prefix_caching,
            drain_timeout=drain_timeout, fault=fault, kv_keys=kv_keys, kv_encryption=kv_encryption,
            control=control)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    from tandem.worker.server.run import run_worker

    sys.exit(run_worker(cfg))


def _model_folder(value: str) -> tuple[Path, str | None]:
    """The local folder for --model (a Hub model is downloaded first) and, for a Hub model, its repository id."""
    from tandem.worker.model.hub import HubError
    from tandem.worker.model.hub import resolve as resolve_model

    try:
        folder, hub_name = resolve_model(value, log.info)
    except HubError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    if not folder.is_dir():
        raise click.BadParameter(f"{folder} is not a folder, and not a Hub repository id (ORG/NAME[@REVISION])",
                                 param_hint="--model")
    return folder, hub_name
