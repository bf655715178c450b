"""Model folders: our tiny-model writer, the CLI wrapper, and clear errors for bad folders."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from tandem.worker.commands.tiny_model import command as make_tiny_model
from tandem.worker.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.worker.model.loader import load_model

from .conftest import FAMILIES, HFModel, random_prompts


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_writes_a_loadable_model_of_each_family(tmp_path: Path, family: str) -> None:
    result = CliRunner().invoke(make_tiny_model, [str(tmp_path / family), "--family", family, "--layers", "3"])
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / family).iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    engine = LLMEngine(EngineConfig(model_dir=str(tmp_path / family), kv_cache_bytes=1 << 20))
    assert engine.model_config.family == family and engine.model_config.num_layers == 3
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": "Grüß dich 🙂"}]),
                                     add_special_tokens=False)
    [tokens] = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(tokens) == 4


def test_tiny_model_loads_in_transformers_too(tmp_path: Path, hf_model: Callable[..., HFModel]) -> None:
    """Our writer's folders are real Hugging Face folders: transformers reads them and agrees."""
    from transformers import AutoModelForCausalLM

    from tandem.worker.model.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "q3", family="qwen3", seed=3)
    reference = HFModel(path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())  # type: ignore[no-untyped-call]
    prompts = random_prompts((14, 33), seed=30)
    got = reference.engine().generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert got == [reference.greedy(p, 6) for p in prompts]


def test_same_seed_same_weights(tmp_path: Path) -> None:
    from tandem.worker.model.tiny import write_tiny_model

    a = load_file(str(write_tiny_model(tmp_path / "a", seed=5) / "model.safetensors"))
    b = load_file(str(write_tiny_model(tmp_path / "b", seed=5) / "model.safetensors"))
    c = load_file(str(write_tiny_model(tmp_path / "c", seed=6) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_unknown_family_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(make_tiny_model, [str(tmp_path / "x"), "--family", "gpt2"])
    assert result.exit_code == 2 and "gpt2" in result.output


def test_unsupported_architecture(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model architecture 'GPT2LMHeadModel'; supported: ") as err:
        load_model(path)
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert supported in str(err.value)


def test_unsupported_rope_scaling(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported RoPE scaling 'yarn'"):
        load_model(path)


def test_missing_weights_and_tensors(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        load_model(path)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj.weight has shape \(3, 3\)"):
        load_model(path)


def test_index_naming_a_missing_shard(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(path)


def test_missing_model_folder() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(EngineConfig(model_dir="/nonexistent/model"))
