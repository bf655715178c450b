#!/usr/bin/env python3
"""Engine benchmark: Tandem's engine against transformers generate, on the same model, in one run.

    .venv/bin/python hack/bench_engine.py [--json OUT] [--quick] [--skip-gpu]

CPU section (always): a tiny-ish random Llama written by tandem's own writer and loaded by
both engines.
  - fixed batch: B equal-length prompts, N new tokens each (greedy), output tokens/s;
  - stream: mixed prompt/output lengths. transformers runs them in arrival-order static batches
    of the same size (left padding; a batch runs until its longest request ends, only the
    requested tokens count); Tandem gets them all at once with the same max_num_seqs.
  - peak memory: each (system, scenario) runs in its own child process; we report its peak RSS
    and the growth over the RSS right after loading the model (KV + activations + overhead).
GPU section (only where CUDA is available; it says so and skips elsewhere): a Llama-3-8B-shaped
model with random bf16 weights, built in device memory (no checkpoint):
  - decode step time for several batch sizes vs the HBM roofline,
    (weight bytes + KV bytes read) / bandwidth, the bandwidth measured by a device copy in the same run;
  - prefill TFLOP/s (2 x params x tokens + attention).
Ratios are the point; absolute CPU times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPEATS = 3  # each system runs its workload this many times; the fastest counts (a shared machine is noisy)
BENCH_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, vocab_size=2048, max_position_embeddings=4096)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def workload(scenario: str, quick: bool) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(0)
    if scenario == "fixed":
        batch, prompt_len, new = (8, 64, 32) if quick else (16, 128, 64)
        return [torch.randint(4, 2000, (prompt_len,), generator=gen).tolist() for _ in range(batch)], [new] * batch
    count = 24 if quick else 64
    prompt_lens = torch.randint(8, 384, (count,), generator=gen).tolist()
    out_lens = torch.randint(4, 128, (count,), generator=gen).tolist()
    prompts = [torch.randint(4, 2000, (n,), generator=gen).tolist() for n in prompt_lens]
    return prompts, out_lens


def run_tandem(model_dir: str, prompts: list[list[int]], out_lens: list[int], max_seqs: int) -> dict[str, Any]:
    from tandem.worker.engine import EngineConfig, LLMEngine, SamplingParams

    # Size the KV cache to the workload (as a deployment sizes it to its traffic), not to RAM.
    need = sum(len(p) + n for p, n in zip(prompts, out_lens, strict=True))
    engine = LLMEngine(EngineConfig(model_dir=model_dir, max_num_seqs=max_seqs, max_num_batched_tokens=512,
                                    kv_cache_bytes=2 * need * _tandem_bytes_per_token(model_dir),
                                    max_model_len=1024))
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    base = rss_mib()
    best, best_cpu = float("inf"), float("inf")
    for rep in range(REPEATS):
        for i, (p, n) in enumerate(zip(prompts, out_lens, strict=True)):
            engine.add_request(f"{rep}-{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens = sum(len(o.new_token_ids) for o in engine.iter_outputs())
        best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - start_cpu)
        engine.kv.pool.reset_prefix_cache()  # each repetition starts cold, like the first
    return {"tokens": tokens, "seconds": best, "cpu_seconds": best_cpu, "base_rss_mib": base}


def _tandem_bytes_per_token(model_dir: str) -> int:
    from tandem.worker.model.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    return int(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4)


def run_hf(model_dir: str, prompts: list[list[int]], out_lens: list[int], max_seqs: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    with torch.inference_mode():  # warm-up
        model.generate(torch.tensor(prompts[:2]) if len({len(p) for p in prompts[:2]}) == 1 else
                       torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    base = rss_mib()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(REPEATS):
        tokens = 0
        start, start_cpu = time.perf_counter(), time.process_time()
        for lo in range(0, len(prompts), max_seqs):
            batch, lens = prompts[lo:lo + max_seqs], out_lens[lo:lo + max_seqs]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens += sum(lens)  # only the tokens each request asked for are useful output
        best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - start_cpu)
    return {"tokens": tokens, "seconds": best, "cpu_seconds": best_cpu, "base_rss_mib": base}


def child(system: str, scenario: str, model_dir: str, quick: bool, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    prompts, out_lens = workload(scenario, quick)
    max_seqs = len(prompts) if scenario == "fixed" else 16
    run = run_tandem if system == "tandem" else run_hf
    result = run(model_dir, prompts, out_lens, max_seqs)
    result.update(system=system, scenario=scenario, peak_rss_mib=peak_rss_mib(),
                  tokens_per_s=result["tokens"] / result["seconds"],
                  tokens_per_cpu_s=result["tokens"] / result["cpu_seconds"])
    result["peak_growth_mib"] = result["peak_rss_mib"] - result["base_rss_mib"]
    print("RESULT " + json.dumps(result))


def cpu_section(quick: bool, threads: int) -> dict[str, Any]:
    from tandem.worker.model.tiny import write_tiny_model

    out: dict[str, Any] = {"model": BENCH_MODEL, "threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "bench-llama", family="llama", **BENCH_MODEL))
        for scenario in ("fixed", "stream"):
            results = {}
            for system in ("tandem", "transformers"):
                proc = subprocess.run([sys.executable, __file__, "--child", system, scenario, model_dir,
                                       "--threads", str(threads)] + (["--quick"] if quick else []), capture_output=True, text=True, check=False)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    raise RuntimeError(f"{system}/{scenario} failed:\n{proc.stderr[-3000:]}")
                results[system] = json.loads(line[len("RESULT "):])
            t, h = results["tandem"], results["transformers"]
            out[scenario] = {**results, "throughput_ratio": t["tokens_per_s"] / h["tokens_per_s"],
                             "cpu_efficiency_ratio": t["tokens_per_cpu_s"] / h["tokens_per_cpu_s"],
                             "peak_rss_ratio": t["peak_rss_mib"] / h["peak_rss_mib"]}
            print(f"cpu {scenario:6s}: tandem {t['tokens_per_s']:8.1f} tok/s, transformers {h['tokens_per_s']:8.1f} "
                  f"tok/s -> x{out[scenario]['throughput_ratio']:.2f} (per CPU-second: "
                  f"x{out[scenario]['cpu_efficiency_ratio']:.2f}); peak RSS {t['peak_rss_mib']:.0f} vs "
                  f"{h['peak_rss_mib']:.0f} MiB (growth over loaded model {t['peak_growth_mib']:.0f} vs "
                  f"{h['peak_growth_mib']:.0f} MiB)", flush=True)
    return out


# ---------------------------------------------------------------- GPU

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                 rope_theta=500000.0, architectures=["LlamaForCausalLM"], model_type="llama")
TINY_SHAPE = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)


class _NoText:
    """The GPU section drives the model runner directly; its sequences need no text."""

    def push(self, token_id: int) -> str:
        return ""


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    n = 1 << 28 if device.type == "cuda" else 1 << 22
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    reps = 20
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * n * reps / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_section(device: torch.device, shape: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    from tandem.worker.engine import SamplingParams
    from tandem.worker.engine.detokenizer import OutputText
    from tandem.worker.engine.runner import ModelRunner
    from tandem.worker.engine.sequence import Sequence
    from tandem.worker.model.config import ModelConfig
    from tandem.worker.model.llama import CausalLM

    cfg = ModelConfig.from_dict(shape, name="llama3-8b-shaped")
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02) if not name.endswith("norm.weight") else p.fill_(1.0)
    model.init_buffers(device)
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    block_size, ctx = 16, 1024
    batches = (1, 8, 32, 64) if device.type == "cuda" else (1, 4)
    blocks_per_seq = ctx // block_size + 1
    num_blocks = max(batches) * blocks_per_seq + 8
    kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                           dtype=dtype, device=device)
    runner = ModelRunner(model, kv_cache, block_size, device)
    bandwidth = measure_bandwidth(device)
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_cache.element_size()
    try:
        import flash_attn  # noqa: F401

        attention = "torch SDPA (flash-attn importable; its paged path needs 256-token blocks)"
    except Exception:
        attention = "torch SDPA"
    out: dict[str, Any] = {"attention": attention,
                           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "params": params, "weight_bytes": weight_bytes, "measured_copy_bandwidth_gbs":
                           bandwidth / 1e9, "context_len": ctx, "decode": [], "prefill": []}
    print(f"gpu: {out['device']}, {params / 1e9:.2f} B params, copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)

    def make_seq(i: int, n_tokens: int, computed: int) -> Sequence:
        seq = Sequence(f"s{i}", [1] * n_tokens, SamplingParams(), 0.0, OutputText(_NoText(), []), None)
        seq.num_computed_tokens = computed
        seq.block_table = list(range(i * blocks_per_seq, i * blocks_per_seq + -(-n_tokens // block_size)))
        return seq

    for batch in batches:
        seqs = [make_seq(i, ctx, ctx - 1) for i in range(batch)]
        step = [(s, 1) for s in seqs]
        for _ in range(3):
            runner.execute(step, seqs)
        _sync(device)
        reps = 10
        start = time.perf_counter()
        for _ in range(reps):
            runner.execute(step, seqs)
        _sync(device)
        seconds = (time.perf_counter() - start) / reps
        roofline = (weight_bytes + batch * ctx * kv_bytes_per_token) / bandwidth
        out["decode"].append({"batch": batch, "step_ms": seconds * 1e3, "roofline_ms": roofline * 1e3,
                              "fraction_of_roofline": roofline / seconds})
        print(f"gpu decode batch {batch:3d} ctx {ctx}: {seconds * 1e3:7.2f} ms/step, roofline "
              f"{roofline * 1e3:6.2f} ms -> {roofline / seconds:.0%} of roofline", flush=True)

    for batch, length in ((1, 2048), (4, 1024)) if device.type == "cuda" else ((1, 64),):
        seqs = [make_seq(i, length, 0) for i in range(batch)]
        step = [(s, length) for s in seqs]
        runner.execute(step, seqs)
        _sync(device)
        reps = 3
        start = time.perf_counter()
        for _ in range(reps):
            runner.execute(step, seqs)
        _sync(device)
        seconds = (time.perf_counter() - start) / reps
        tokens = batch * length
        attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * batch * length * length / 2  # causal
        flops = 2 * (params - cfg.vocab_size * cfg.hidden_size) * tokens + attn_flops  # embedding is a lookup
        out["prefill"].append({"batch": batch, "prompt_len": length, "seconds": seconds,
                               "tflops": flops / seconds / 1e12})
        print(f"gpu prefill {batch}x{length}: {seconds * 1e3:.1f} ms, {flops / seconds / 1e12:.1f} TFLOP/s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both systems (1 keeps a shared machine's noise down)")
    parser.add_argument("--skip-gpu", action="store_true")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--gpu-section-on-cpu", action="store_true",
                        help="run the GPU section's code on the CPU with a tiny shape (checks the script, not the GPU)")
    parser.add_argument("--child", nargs=3, metavar=("SYSTEM", "SCENARIO", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        system, scenario, model_dir = args.child
        child(system, scenario, model_dir, quick=args.quick, threads=args.threads)
        return
    results: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                               "cpu_count": os.cpu_count(), "torch": torch.__version__}
    if not args.skip_cpu:
        results["cpu"] = cpu_section(args.quick, args.threads)
    if args.gpu_section_on_cpu:
        results["gpu_code_on_cpu"] = gpu_section(torch.device("cpu"), TINY_SHAPE, torch.float32)
    elif not args.skip_gpu:
        if torch.cuda.is_available():
            results["gpu"] = gpu_section(torch.device("cuda"), LLAMA3_8B, torch.bfloat16)
        else:
            print("gpu: skipped, no CUDA device here (the GPU section runs only where torch.cuda.is_available())")
            results["gpu"] = {"skipped": "no CUDA device"}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
