"""A tensor-parallel engine: one process per rank; rank 0 schedules and samples, the others follow.

`launch_engine(cfg)` starts `cfg.tensor_parallel_size - 1` follower processes and returns rank 0's
`LLMEngine`, which has the single-process engine's interface (plus `close()`, which stops the
followers). Every rank builds the same `LLMEngine` around its share of the weights
(`tensor_parallel.py`) and its own KV cache of its KV heads; the followers then only run steps.

Each step, rank 0 publishes the step's plan (`runner.Chunk`s: per sequence its new tokens, the first
one's position and its block table) as JSON under `tandem/plan/<step>` in the group's TCPStore, and
every rank runs the same forward on it, kept in lockstep by the all-reduces. Only rank 0 samples
(the followers ask the model for no logits). The plan goes through the store rather than a gloo
broadcast because the root of a broadcast waits for every receiver (a stuck follower would hold rank
0 with no timeout) and a receiver's wait would time out while the engine idles; the store's server
runs in rank 0, and a follower may wait on a key for as long as the engine has nothing to do.

Failures: the all-reduces time out after `cfg.tp_timeout_s` (gloo on CPU, NCCL on CUDA, whose
watchdog then ends the process itself). On rank 0, any failure during a step ends the group (the
ranks are no longer in step) and raises `TensorParallelError` naming the rank that caused it: one that
died, by its exit code or signal, or one still running that did not take part (stuck). A follower
whose own collective failed exits with `EXIT_COLLECTIVE` (a victim, not the cause); one that loses
rank 0 exits too, so no rank outlives its group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch re-exports it without saying so

from ..config import EngineConfig
from ..model.config import ModelConfig
from ..model.tensor_parallel import CollectiveError, TensorParallel

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .runner import Chunk

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # one pod, one machine: the ranks are local processes
LOOPBACK_INTERFACE = "lo"
EXIT_COLLECTIVE = 3  # a follower whose collective failed because another rank did
POLL_S = 0.02  # rank 0's wait for the others in the store (at start-up) checks its followers this often
IDLE = timedelta(hours=1)  # a follower's wait for the next plan, renewed for as long as the engine idles
GRACE_S = 2.0  # after a failure, how long rank 0 waits for the culprit's exit to show


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed; the message names the rank that caused it."""


class TPGroup:
    """One rank's side of the group: its model shard (`shard`), the store, and on rank 0 the followers."""

    def __init__(self, rank: int, size: int, store: TCPStore, timeout_s: float,
                 followers: Sequence[BaseProcess] = ()) -> None:
        self.rank, self.size, self.store, self.timeout_s = rank, size, store, timeout_s
        self.shard = TensorParallel(rank, size)
        self.followers = list(followers)  # rank 0: the processes of ranks 1..size-1
        self.step_index = 0
        self.failure: str | None = None
        self.closed = False
        self.listener: socket.socket | None = None  # rank 0: the store's loopback socket

    @classmethod
    def start(cls, cfg: EngineConfig) -> TPGroup:
        """Rank 0: start the followers and the process group."""
        if dist.is_initialized():
            raise RuntimeError("this process already runs a torch.distributed group (another tensor-parallel "
                               "engine?): close that one first")
        size = cfg.tensor_parallel_size
        listener = _loopback_listener()
        store = TCPStore(HOST, listener.getsockname()[1], size, is_master=True,
                         timeout=timedelta(seconds=cfg.tp_timeout_s), wait_for_workers=False,
                         master_listen_fd=listener.fileno())
        ctx = mp.get_context("spawn")
        followers = [ctx.Process(target=_follower_main, args=(rank, cfg, store.port), name=f"tandem-tp-rank{rank}",
                                 daemon=True) for rank in range(1, size)]
        for p in followers:
            p.start()
        group = cls(0, size, store, cfg.tp_timeout_s, followers)
        group.listener = listener  # the store serves on its descriptor: it must stay open
        try:
            group._init_process_group(rank_device(cfg.device, 0))
        except Exception as exc:
            group.fail(exc)
        return group

    def _init_process_group(self, device: str) -> None:
        """`device`: this rank's (cpu, or cuda:N)."""
        # Starting a rank (a process importing torch) can take longer than a collective may: meet in the
        # store first, rank 0 watching its followers, so the process group forms at once.
        self._exchange("joined", "")
        # The collectives' own sockets on loopback too (gloo's pairs, NCCL's bootstrap): the ranks are local.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
        backend = "gloo"
        if device.startswith("cuda"):
            backend = "nccl"
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, store=self.store, rank=self.rank, world_size=self.size,
                                timeout=timedelta(seconds=self.timeout_s))

    # ----- rank 0 -----

    def publish(self, plan: list[Chunk] | None) -> None:
        """Hand the next step's plan (None: stop) to the followers."""
        self.store.set(f"tandem/plan/{self.step_index}", json.dumps(plan))
        if self.step_index:  # every follower has read the previous plan: this step's all-reduces need them all
            self.store.delete_key(f"tandem/plan/{self.step_index - 1}")
        self.step_index += 1

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step on rank 0: refuses to start on a failed group; any failure inside ends the group."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        self._check_followers()
        try:
            yield
        except Exception as exc:
            self.fail(exc)

    def check(self) -> None:
        """Rank 0, between steps: raise TensorParallelError if the group has failed or a follower has exited."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        self._check_followers()

    def fail(self, exc: BaseException) -> NoReturn:
        """End the group after `exc` and raise the error that names the rank responsible."""
        self.failure = self.failure or self._diagnose(exc)
        self.close()
        raise TensorParallelError(self.failure) from exc

    def abort(self) -> None:
        """End the group now (rank 0's own setup failed): the followers are killed, not asked to stop."""
        self.failure = self.failure or "aborted by rank 0"
        self.close()

    def _check_followers(self) -> None:
        dead = [(r, p) for r, p in enumerate(self.followers, 1) if p.exitcode is not None]
        if dead:
            self.failure = "; ".join(_describe(r, p) for r, p in dead)
            self.close()
            raise TensorParallelError(self.failure)

    def _diagnose(self, exc: BaseException) -> str:
        if not isinstance(exc, CollectiveError | dist.DistError):
            return f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}"
        deadline = time.monotonic() + GRACE_S
        while True:  # a killed rank's exit can take a moment to show; its victims' exits may show first
            culprits = [(r, p) for r, p in enumerate(self.followers, 1) if p.exitcode not in (None, EXIT_COLLECTIVE)]
            if culprits or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if culprits:
            return "; ".join(_describe(r, p) for r, p in culprits) + f" (rank 0 saw: {exc})"
        stuck = [r for r, p in enumerate(self.followers, 1) if p.exitcode is None]
        if stuck:
            return (f"tensor-parallel rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} still running "
                    f"but did not complete a collective within {self.timeout_s:g} s (stuck?): {exc}")
        return f"a collective failed on every rank: {exc}"

    def agree_min(self, value: int) -> int:
        """Every rank's `value` (its KV block count), the smallest: all ranks' caches must hold the same blocks."""
        return min(int(v) for v in self._exchange("min", str(value)))

    def _exchange(self, name: str, value: str) -> list[str]:
        """Every rank's `value` under `name`, in rank order, once all have given theirs (as long as loading
        takes: this waits in the store, not in a collective, and rank 0 checks its followers meanwhile)."""
        self.store.set(f"tandem/{name}/{self.rank}", value)
        keys = [f"tandem/{name}/{r}" for r in range(self.size)]
        self._wait(keys)
        return [self.store.get(k).decode() for k in keys]

    def _wait(self, keys: list[str]) -> None:
        """Until `keys` are in the store, however long: rank 0 polls, checking its followers in between; a
        follower blocks (renewing the wait every IDLE) and fails if rank 0, the store's server, goes away."""
        while True:
            try:
                if self.rank != 0:
                    self.store.wait(keys, IDLE)
                    return
                if self.store.check(keys):
                    return
                self._check_followers()
                time.sleep(POLL_S)
            except dist.DistStoreError:  # an idle hour went by
                continue
            except dist.DistNetworkError as exc:
                raise CollectiveError(f"tensor-parallel rank {self.rank} lost rank 0: {str(exc).splitlines()[0]}") from exc

    def close(self) -> None:
        """Rank 0: stop the followers (killing those that do not stop) and leave the process group."""
        if self.closed or self.rank != 0:
            return
        self.closed = True
        if self.failure is None:
            with contextlib.suppress(Exception):
                self.publish(None)
        for p in self.followers:
            p.join(timeout=10 if self.failure is None else 0)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()

    # ----- followers -----

    def receive(self) -> list[Chunk] | None:
        """The next step's plan from rank 0 (None: stop); waits for as long as rank 0 has nothing to run."""
        key = f"tandem/plan/{self.step_index}"
        self.step_index += 1
        self._wait([key])
        plan: list[Chunk] | None = json.loads(self.store.get(key))
        return plan


def launch_engine(cfg: EngineConfig, progress: Callable[[str, float], None] | None = None) -> LLMEngine:
    """Rank 0's engine of `cfg.tensor_parallel_size` ranks (a plain `LLMEngine` at size 1); call `close()` when done."""
    from .llm_engine import LLMEngine

    if cfg.tensor_parallel_size == 1:
        return LLMEngine(cfg, progress)
    TensorParallel(0, cfg.tensor_parallel_size).check(ModelConfig.from_dir(cfg.model_dir))  # before any process
    group = TPGroup.start(cfg)
    try:
        return LLMEngine(cfg, progress, tp=group)
    except BaseException:
        group.abort()
        raise


def _loopback_listener() -> socket.socket:
    """A listening socket on 127.0.0.1 for the store's server: given a host, TCPStore still listens on every
    interface, and the store is unauthenticated (whoever writes a plan drives every rank)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(128)
    return listener


def rank_device(device: str, rank: int) -> str:
    """A rank's device: CUDA ranks take consecutive GPUs from the configured one."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


def _follower_main(rank: int, cfg: EngineConfig, port: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")
    code = 0
    try:
        cfg = dataclasses.replace(cfg, device=rank_device(cfg.device, rank))
        if cfg.device == "cpu":  # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.tensor_parallel_size))
        store = TCPStore(HOST, port, cfg.tensor_parallel_size, is_master=False,
                         timeout=timedelta(seconds=cfg.tp_timeout_s))
        group = TPGroup(rank, cfg.tensor_parallel_size, store, cfg.tp_timeout_s)
        group._init_process_group(cfg.device)
        from .llm_engine import LLMEngine

        engine = LLMEngine(cfg, tp=group)
        while (plan := group.receive()) is not None:
            engine.runner.run(plan, [])
    except (CollectiveError, dist.DistError) as exc:
        log.error("a collective failed, ending this rank: %s", exc)
        code = EXIT_COLLECTIVE
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    logging.shutdown()
    os._exit(code)  # no interpreter teardown: gloo's threads may still be blocked on a dead peer


def _describe(rank: int, process: BaseProcess) -> str:
    code = process.exitcode
    assert code is not None
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    elif code == EXIT_COLLECTIVE:
        how = "ended after a failed collective"
    else:
        how = f"exited with code {code}"
    return f"tensor-parallel rank {rank} (pid {process.pid}) {how}"

